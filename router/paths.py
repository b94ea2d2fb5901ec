"""Request paths: where a request goes below the application's root, and which paths make the
engines work (counted by --enable-server-load-tracking, guarded by --api-key)."""

from __future__ import annotations

from starlette.types import Scope

from router.classification import CLASSIFY_PATHS
from router.cohere_embed import COHERE_EMBED_PATH
from router.invocations import INVOCATIONS_PATH
from router.messages import MESSAGES_PATH
from router.pooling import POOLING_PATHS
from router.scoring import SCORING_PATHS

# Generation and pooling, and SageMaker's path for both.
ENGINE_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses", MESSAGES_PATH,
                          "/v1/embeddings", COHERE_EMBED_PATH, *SCORING_PATHS, *CLASSIFY_PATHS, *POOLING_PATHS,
                          INVOCATIONS_PATH})


def route_path(scope: Scope) -> str:
    """The request's path below the application's root path (Serve mounts apps under a prefix)."""
    path, root = scope["path"], scope.get("root_path", "")
    # (Only at a segment's end: under a root of "/p", "/pause" is not "ause", as Starlette reads it.)
    if not root or not path.startswith(root):
        return path
    if path == root:
        return ""
    return path[len(root):] if path[len(root)] == "/" else path
