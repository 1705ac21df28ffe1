"""Vision-language parts on the NPU spec: Qwen3-VL's vision tower, its interleaved multimodal
RoPE and the positions both use (docs/vision.md)."""

from mcore_npu.transformer.vision.mrope import InterleavedMultimodalRotaryEmbedding
from mcore_npu.transformer.vision.positions import rope_index
from mcore_npu.transformer.vision.tower import NPUVisionTower, VisionShape, vision_block_spec

__all__ = [
    "InterleavedMultimodalRotaryEmbedding",
    "NPUVisionTower",
    "VisionShape",
    "rope_index",
    "vision_block_spec",
]
