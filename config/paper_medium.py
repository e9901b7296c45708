# The DeepLoop paper's Table 1 setup at GPT-2 medium size: 24 physical blocks of width 1024 (16 heads) looped R times,
# otherwise as config/paper_small.py (RMSNorm, RoPE, x = RMSNorm(alpha * x + f(RMSNorm(x))), FineWeb-Edu, context
# 1024, 480 sequences per step, 100K steps, ~50B tokens). R is set on the command line:
#   python prepare_data.py fineweb_edu
#   torchrun --standalone --nproc_per_node=8 train.py config/paper_medium.py --n_loop=3 --out_dir=out-paper-medium-deeploop-R3
# The baseline is Pre-LN at the same R: --residual=preln.
out_dir = "out-paper-medium"
dataset = "fineweb_edu"
wandb_run_name = "paper-medium"

n_layer = 24
n_loop = 1  # R: the paper runs 1, 3, 5 and 7
n_head = 16
n_embd = 1024
block_size = 1024
dropout = 0.0
residual = "deeploop"
norm = "rmsnorm"
position_encoding = "rope"
norm_branch_input = True

# 6 sequences x 80 micro-batches = 480 sequences (491,520 tokens) per step; 80 is the total over all processes, so
# 1, 2, 4 or 8 GPUs divide it. Activations grow with the unrolled depth 24 * R: when memory runs out, lower
# batch_size and raise gradient_accumulation_steps by the same factor (--batch_size=2
# --gradient_accumulation_steps=240 is the same step).
batch_size = 6
gradient_accumulation_steps = 80

# The paper does not give its optimizer settings; these are GPT-3 medium's (Brown et al. 2020, table 2.1): peak
# learning rate 3e-4, cosine decay to 10% of it over the run. Warmup is nanoGPT's GPT-2 recipe (2000 steps, ~1B
# tokens). AdamW betas (0.9, 0.95), weight decay 0.1 and gradient clipping at 1.0 are GPT-3's too, and train.py's
# defaults.
learning_rate = 3e-4
max_iters = 100000
lr_decay_iters = 100000
warmup_iters = 2000
min_lr = 3e-5
