"""Model configs, checkpoint loading and Llama-family implementations."""

from pagedllm.models.config import ModelConfig
from pagedllm.models.loader import Checkpoint, default_model_path, load_checkpoint

__all__ = ["Checkpoint", "ModelConfig", "default_model_path", "load_checkpoint"]
