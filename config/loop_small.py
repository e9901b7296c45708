# GPT-2 small's width (768, 12 heads) and unrolled depth (12), stored as 6 physical blocks run twice: GPT-2 small's
# compute per token with about half its block parameters. nanoGPT's GPT-2 (124M) recipe otherwise: OpenWebText,
# ~0.5M tokens per step, 600k steps (~300B tokens), lr 6e-4 with 2000 warmup steps and cosine decay to 6e-5.
#   python prepare_data.py openwebtext
#   torchrun --standalone --nproc_per_node=8 train.py config/loop_small.py
# Baselines with the same compute: --residual=deepnorm (DeepNorm's exponents), --n_layer=12 --n_loop=1 (untied).
out_dir = "out-loop-small"
dataset = "openwebtext"
wandb_run_name = "loop-small"

n_layer = 6
n_loop = 2  # unrolled depth 12
n_head = 12
n_embd = 768
block_size = 1024
dropout = 0.0
residual = "deeploop"

# 12 sequences x 1024 tokens x 40 micro-batches = 491,520 tokens per step; 40 is the total over all processes
# (5 per GPU on 8 GPUs)
batch_size = 12
gradient_accumulation_steps = 40

learning_rate = 6e-4
max_iters = 600000
lr_decay_iters = 600000
warmup_iters = 2000
min_lr = 6e-5
# weight decay, AdamW betas, gradient clipping and the eval/log intervals are train.py's defaults
