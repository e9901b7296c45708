# GPT-2 medium's width (1024, 16 heads) and unrolled depth (24), stored as 12 physical blocks run twice: GPT-2
# medium's compute per token with about half its block parameters. ~0.5M tokens per step on OpenWebText.
#   python prepare_data.py openwebtext
#   torchrun --standalone --nproc_per_node=8 train.py config/loop_medium.py
# Baselines: --residual=deepnorm, --n_layer=24 --n_loop=1.
out_dir = "out-loop-medium"
dataset = "openwebtext"
wandb_run_name = "loop-medium"

n_layer = 12
n_loop = 2  # unrolled depth 24
n_head = 16
n_embd = 1024
block_size = 1024
dropout = 0.0
residual = "deeploop"

# 12 x 1024 x 40 = 491,520 tokens per step (40 micro-batches in total over all processes)
batch_size = 12
gradient_accumulation_steps = 40

learning_rate = 3e-4  # GPT-3 medium's: wider models take a smaller rate
max_iters = 600000
lr_decay_iters = 600000
warmup_iters = 2000
min_lr = 3e-5
# weight decay, AdamW betas, gradient clipping and the eval/log intervals are train.py's defaults
