from gpu_worker.models.registry import MODEL_REGISTRY, build_model, get_model_class

__all__ = ["MODEL_REGISTRY", "build_model", "get_model_class"]
