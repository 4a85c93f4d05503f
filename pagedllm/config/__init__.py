"""Engine settings and their help; the device, dtype and KV dtype they resolve to (once, here)."""

from pagedllm.config.args import EngineArgs
from pagedllm.config.device import DeviceConfig

__all__ = ["DeviceConfig", "EngineArgs"]
