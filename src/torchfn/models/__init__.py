"""Model definitions (plain nn.Modules; make them pure with torchfn.Model)."""

from torchfn.models._aggregate import GINConv, SAGEConv, aggregate_neighbours
from torchfn.models._bailing_hybrid import bailing_hybrid_from_hf, bailing_hybrid_to_hf
from torchfn.models._beam_search import beam_search
from torchfn.models._cnn import BasicBlock, ConvNet, ResNet
from torchfn.models._ctc_decode import ctc_decode
from torchfn.models._dbrx import dbrx_from_hf, dbrx_to_hf
from torchfn.models._deepseek import deepseek_from_hf, deepseek_to_hf
from torchfn.models._delta_net import GatedDeltaNet
from torchfn.models._denoiser import MLPDenoiser, fourier_features, timestep_embedding
from torchfn.models._dequantize import dequantize_fp8, dequantize_mxfp4
from torchfn.models._dsa import LightningIndexer
from torchfn.models._energy import MLPEnergy
from torchfn.models._falcon_h1 import falcon_h1_from_hf, falcon_h1_to_hf
from torchfn.models._from_transformers import from_transformers
from torchfn.models._gan import ConvCritic, ConvGenerator
from torchfn.models._gat import GATConv
from torchfn.models._generate import generate, sample_logits
from torchfn.models._graph import GraphAttention, GraphConv
from torchfn.models._jetmoe import jetmoe_from_hf, jetmoe_to_hf
from torchfn.models._kda import KimiDeltaAttention
from torchfn.models._kimi_linear import kimi_linear_from_hf, kimi_linear_to_hf
from torchfn.models._kv_cache import KVCache, StaticKVCache
from torchfn.models._lfm2 import lfm2_from_hf, lfm2_to_hf
from torchfn.models._lightning import LightningAttention, lightning_slopes
from torchfn.models._llama import llama_from_hf
from torchfn.models._llama4 import llama4_from_hf, llama4_to_hf
from torchfn.models._llama_export import llama_to_hf
from torchfn.models._lora import (
    LoRAConv1d,
    LoRAConv2d,
    LoRAConv3d,
    LoRAEmbedding,
    LoRALinear,
    merge_lora,
    split_lora,
    with_lora,
)
from torchfn.models._mamba import Mamba
from torchfn.models._mamba2 import Mamba2
from torchfn.models._mamba_hybrid import mamba_hybrid_from_hf, mamba_hybrid_to_hf
from torchfn.models._minimax import minimax_from_hf, minimax_to_hf
from torchfn.models._mla import LatentAttention
from torchfn.models._mlp import MLP, XIELU, SwiGLU
from torchfn.models._mlstm import MLSTM
from torchfn.models._moa import MixtureOfAttention
from torchfn.models._moe import MoE, moe_bias_update
from torchfn.models._mtp import MultiTokenPrediction
from torchfn.models._mtp_decode import mtp_speculative_generate
from torchfn.models._nemotron_h import nemotron_h_from_hf, nemotron_h_to_hf
from torchfn.models._neox import neox_from_hf, neox_to_hf
from torchfn.models._nerf import NeRF
from torchfn.models._olmo_hybrid import olmo_hybrid_from_hf, olmo_hybrid_to_hf
from torchfn.models._phi import phi_from_hf, phi_to_hf
from torchfn.models._pretrained import (
    deepseek_from_pretrained,
    deepseek_save_pretrained,
    from_pretrained,
    llama_from_pretrained,
    llama_save_pretrained,
    save_pretrained,
)
from torchfn.models._qwen3_next import qwen3_next_from_hf, qwen3_next_to_hf
from torchfn.models._recurrent_gemma import recurrent_gemma_from_hf, recurrent_gemma_to_hf
from torchfn.models._rg_lru import RGLRU
from torchfn.models._rnn import GRU, LSTM
from torchfn.models._rotary import rotary_embedding
from torchfn.models._rotary_scaling import rotary_frequencies
from torchfn.models._routed_moe import routed_moe_from_hf, routed_moe_to_hf
from torchfn.models._short_conv import ShortConv
from torchfn.models._speculative import speculative_generate
from torchfn.models._transformer import MultiHeadAttention, TransformerBlock, TransformerEncoder
from torchfn.models._unet import UNet
from torchfn.models._vae import MLPVAE
from torchfn.models._xlstm import xlstm_from_hf, xlstm_to_hf

__all__ = [
    # diffusion denoisers and EBM energy (_denoiser, _unet, _energy)
    "MLPDenoiser",
    "UNet",
    "fourier_features",
    "timestep_embedding",
    "MLPEnergy",
    # MLP, CNNs, Transformer, VAE (_mlp, _cnn, _transformer, _vae)
    "MLP",
    "SwiGLU",
    "XIELU",
    "MoE",
    "moe_bias_update",
    "ConvNet",
    "ResNet",
    "BasicBlock",
    "TransformerEncoder",
    "TransformerBlock",
    "MultiHeadAttention",
    "LatentAttention",
    "LightningIndexer",
    "MultiTokenPrediction",
    "MixtureOfAttention",
    "GatedDeltaNet",
    "KimiDeltaAttention",
    "ShortConv",
    "RGLRU",
    "MLSTM",
    "LightningAttention",
    "lightning_slopes",
    "Mamba",
    "Mamba2",
    # rotary positions, KV-cache decoding and token sampling (_rotary, _kv_cache, _generate)
    "rotary_embedding",
    "rotary_frequencies",
    "KVCache",
    "StaticKVCache",
    "generate",
    "sample_logits",
    "speculative_generate",
    "mtp_speculative_generate",
    "beam_search",
    "ctc_decode",
    "from_pretrained",
    "save_pretrained",
    "llama_from_hf",
    "llama_to_hf",
    "llama4_from_hf",
    "qwen3_next_from_hf",
    "qwen3_next_to_hf",
    "mamba_hybrid_from_hf",
    "mamba_hybrid_to_hf",
    "from_transformers",
    "falcon_h1_from_hf",
    "falcon_h1_to_hf",
    "kimi_linear_from_hf",
    "bailing_hybrid_from_hf",
    "bailing_hybrid_to_hf",
    "kimi_linear_to_hf",
    "lfm2_from_hf",
    "lfm2_to_hf",
    "minimax_from_hf",
    "minimax_to_hf",
    "olmo_hybrid_from_hf",
    "olmo_hybrid_to_hf",
    "recurrent_gemma_from_hf",
    "recurrent_gemma_to_hf",
    "xlstm_from_hf",
    "xlstm_to_hf",
    "routed_moe_from_hf",
    "routed_moe_to_hf",
    "dbrx_from_hf",
    "dbrx_to_hf",
    "jetmoe_from_hf",
    "jetmoe_to_hf",
    "nemotron_h_from_hf",
    "nemotron_h_to_hf",
    "llama4_to_hf",
    "llama_from_pretrained",
    "llama_save_pretrained",
    "deepseek_from_hf",
    "neox_from_hf",
    "neox_to_hf",
    "phi_from_hf",
    "phi_to_hf",
    "deepseek_to_hf",
    "deepseek_from_pretrained",
    "deepseek_save_pretrained",
    "dequantize_fp8",
    "dequantize_mxfp4",
    "MLPVAE",
    # DCGAN generator and critic for small images (_gan)
    "ConvGenerator",
    "ConvCritic",
    # recurrent nets with forward-mode AD (_rnn)
    "LSTM",
    "GRU",
    # graph layers on dense adjacency or edge lists (_graph)
    "GraphConv",
    "GraphAttention",
    "GATConv",
    "SAGEConv",
    "GINConv",
    "aggregate_neighbours",
    # low-rank adapters on Linear, Conv and Embedding layers (_lora)
    "with_lora",
    "split_lora",
    "merge_lora",
    "LoRALinear",
    "LoRAConv1d",
    "LoRAConv2d",
    "LoRAConv3d",
    "LoRAEmbedding",
    # radiance field (_nerf; render with transforms.volume_render)
    "NeRF",
]
