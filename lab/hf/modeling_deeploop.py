"""The exported DeepLoop model as a transformers causal LM. It is model.py's GPT itself (model.py ships beside this
file): this file only adapts the interface, so that there is one definition of the model.

    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
    model(ids).logits                          # the loop count of config.n_loop
    model(ids, n_loop=4).logits                # another count for this call (test-time depth)
    model.generate(ids, max_new_tokens=50, n_loop=4)   # with the KV cache, one entry per unrolled visit

Generation keeps model.py's cache (a list with one KVCache per unrolled visit of a block) inside LoopCache, which
transformers' generate() hands from step to step; once the context outgrows block_size the window slides and the
cache is rebuilt from the last block_size tokens, as the project's own generate does. No attention mask is read:
padding may only end a row, with no token after it (a forward pass of right-padded rows); generate() appends tokens
after any padding, so prompts of unequal length are generated one at a time.
"""

from torch.nn import functional as F
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_deeploop import DeepLoopConfig
from .model import GPT, Rotary


# ---------------------------------------------------------------------------------------------------------------
# every call into model.py

def new_caches(gpt, loops):
    """An empty cache for a pass of `loops` core loops: one entry per unrolled visit."""
    return gpt.new_caches(loops)


def cached_positions(caches):
    return caches[0].past


def logits_of(gpt, idx, loops, caches, last_only):
    logits, _ = gpt(idx, n_loop=loops, caches=caches, last_only=last_only)
    return logits


def fill_buffers(module):
    """The rotary tables, which are no weights (a function of the config): transformers builds the model with empty
    buffers and asks _init_weights to fill what it did not load."""
    if isinstance(module, Rotary):
        fresh = Rotary(2 * module.cos.size(1), module.cos.size(0))
        module.cos.copy_(fresh.cos)
        module.sin.copy_(fresh.sin)


# ---------------------------------------------------------------------------------------------------------------

class LoopCache:
    """generate()'s cache: model.py's per-visit caches of one loop count."""
    is_compileable = False  # what generate() asks of a cache before compiling a step or reusing it
    is_croppable = False

    def __init__(self, gpt, loops):
        self.loops = loops
        self.entries = new_caches(gpt, loops)

    def get_seq_length(self, layer_idx=0):
        return cached_positions(self.entries)


class DeepLoopForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = DeepLoopConfig
    base_model_prefix = "gpt"
    _tied_weights_keys = {"gpt.lm_head.weight": "gpt.transformer.wte.weight"}  # the file holds the embedding only

    def __init__(self, config):
        super().__init__(config)
        self.gpt = GPT(config.gpt_config())
        self.post_init()

    @classmethod
    def _supports_default_dynamic_cache(cls):
        return False  # transformers' DynamicCache holds one entry per layer; this model makes its own LoopCache

    def _init_weights(self, module):
        # The weights come from the file or from model.py's own init (GPT.__init__), never from transformers' init
        fill_buffers(module)

    def get_input_embeddings(self):
        return self.gpt.transformer.wte

    def get_output_embeddings(self):
        return self.gpt.lm_head

    def forward(self, input_ids=None, attention_mask=None, cache=None, use_cache=None, labels=None, n_loop=None,
                logits_to_keep=0, return_dict=None, **kwargs):
        """logits (B, T, vocab) of input_ids (B, T); with labels (B, T) the mean cross-entropy of predicting each
        label from the positions before it (-100: not scored), as transformers' causal LMs do. n_loop: the loops of
        this pass (default config.n_loop). use_cache: return a LoopCache of the pass (or extend `cache`).
        logits_to_keep > 0: the logits of the last logits_to_keep positions only."""
        for name in ("inputs_embeds", "position_ids"):
            if kwargs.get(name) is not None:
                raise ValueError(f"{name} is not an input of this model: pass input_ids (positions follow the cache)")
        for name in ("output_attentions", "output_hidden_states"):
            if kwargs.get(name):
                raise ValueError(f"{name} is not served by this model: its forward pass returns logits (and a loss)")
        loops = n_loop or self.config.n_loop
        if cache is not None and not isinstance(cache, LoopCache):
            raise ValueError(f"cache must be this model's LoopCache (generate() makes one), not {type(cache).__name__}")
        if cache is not None and cache.loops != loops:
            raise ValueError(f"the cache holds the visits of {cache.loops} loops, this pass runs {loops}: start a new "
                             f"one (cache=None)")
        if attention_mask is not None and (attention_mask.cummin(dim=-1).values != attention_mask).any():
            raise ValueError("this model reads no attention mask, so padding may only end a row, with no token after "
                             "it: a forward pass takes right-padded rows, but generate() appends its tokens after the "
                             "padding, so generate prompts of unequal length one at a time")
        if use_cache and cache is None:
            cache = LoopCache(self.gpt, loops)
        logits = logits_of(self.gpt, input_ids, loops, cache.entries if cache is not None else None,
                           last_only=logits_to_keep == 1)  # generate() asks for the last position's only
        if logits_to_keep > 1:
            logits = logits[:, -logits_to_keep:]
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)
        output = CausalLMOutputWithPast(loss=loss, logits=logits, cache=cache)
        return output if return_dict is not False else output.to_tuple()

    def prepare_inputs_for_generation(self, input_ids, next_sequence_length=None, cache=None, attention_mask=None,
                                      **kwargs):
        block_size = self.config.block_size
        if cache is not None and cache.get_seq_length() >= block_size:
            # the window slides: every position embedding shifts, so the last block_size tokens run again into a
            # new cache
            cache, next_sequence_length = None, None
        inputs = super().prepare_inputs_for_generation(input_ids, next_sequence_length=next_sequence_length,
                                                       cache=cache, attention_mask=attention_mask, **kwargs)
        if inputs["input_ids"].size(1) > block_size:
            inputs["input_ids"] = inputs["input_ids"][:, -block_size:]
        if inputs.get("attention_mask") is not None:
            inputs["attention_mask"] = inputs["attention_mask"][:, -block_size:]
        return inputs
