"""OpenAI-compatible HTTP front end: protocol models, detokenisation, routing and the Serve ingress."""
