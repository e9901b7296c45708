"""The settings of an exported DeepLoop model, as transformers reads them from config.json.

Every field of model.py's GPTConfig is a field here under its own name (model.py ships beside this file), so that the
model's settings live in one place. Loading with a field changed changes the model built, e.g.

    AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, n_loop=4)   # 4 loops in every forward pass

n_loop is the count of core loops a forward pass runs when it names none; alpha, beta and preln_scaled's epsilon come
from coefficient_loops, which the export sets to the trained count, so changing n_loop changes the test-time depth,
not the model (as model.GPT.forward's n_loop does).
"""

from dataclasses import MISSING, fields

from transformers import PretrainedConfig

from .model import GPTConfig


class DeepLoopConfig(PretrainedConfig):
    model_type = "deeploop"
    # the names that tools read for the width, the heads and the longest context
    attribute_map = {"hidden_size": "n_embd", "num_attention_heads": "n_head", "max_position_embeddings": "block_size"}

    def __init__(self, **kwargs):
        for field in fields(GPTConfig):
            default = field.default if field.default is not MISSING else None
            setattr(self, field.name, kwargs.pop(field.name, default))
        self.n_loop_trained = kwargs.pop("n_loop_trained", self.n_loop)
        self.tokenizer = kwargs.pop("tokenizer", None)  # the project's tokenizer name: gpt2 or bytes
        kwargs.setdefault("tie_word_embeddings", True)  # the output layer is the token embedding
        super().__init__(**kwargs)

    def gpt_config(self):
        """model.py's GPTConfig of these settings (it checks them)."""
        return GPTConfig(**{field.name: getattr(self, field.name) for field in fields(GPTConfig)})
