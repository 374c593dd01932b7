"""raypai.train: distributed pretraining on Ray Train + DeepSpeed.

from raypai.train import ModelConfig, PretrainConfig, pretrain
pretrain("shards/", "tokenizer/", "out/model", PretrainConfig(model=ModelConfig(layers=2)),
         name="run-1", storage_path=".raypai/train")
"""

from raypai.train.checkpoint import latest_checkpoint
from raypai.train.config import ModelConfig, PretrainConfig
from raypai.train.export import export_model
from raypai.train.model import build_model, flops_per_token, param_count
from raypai.train.strategy import MemoryEstimate
from raypai.train.trainer import plan, pretrain

__all__ = [
    "ModelConfig",
    "PretrainConfig",
    "pretrain",
    "plan",
    "build_model",
    "param_count",
    "flops_per_token",
    "MemoryEstimate",
    "export_model",
    "latest_checkpoint",
]
