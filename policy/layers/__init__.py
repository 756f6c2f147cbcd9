"""Layers of the hybrid: KDA and gated MLA/DSA mixers, Block AttnRes, (Latent)MoE, norms."""
from .attnres import AttnRes, attn_res_mix
from .kda import KDAMixer
from .mla import LightningIndexer, MLAMixer
from .moe import GatedMLP, LatentMoE, Router
from .norms import GatedRMSNorm, RMSNorm

__all__ = ["AttnRes", "attn_res_mix", "KDAMixer", "MLAMixer", "LightningIndexer", "GatedMLP", "LatentMoE",
           "Router", "RMSNorm", "GatedRMSNorm"]
