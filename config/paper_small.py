# The DeepLoop paper's Table 1 setup at GPT-2 small size, as far as the paper states it: 12 physical blocks of width
# 768 (12 heads) looped R times, its "GPT-MHA-RoPE" backbone (RMSNorm, rotary positions, the Post-LN block
# x = RMSNorm(alpha * x + f(RMSNorm(x))) with a normalized input embedding), FineWeb-Edu, context 1024, 480
# sequences per step, 100K steps (480 x 1024 x 100,000 = 49.2B tokens, the paper's ~50B). R is set on the command line:
#   python prepare_data.py fineweb_edu
#   torchrun --standalone --nproc_per_node=8 train.py config/paper_small.py --n_loop=3 --out_dir=out-paper-small-deeploop-R3
# The baseline is Pre-LN at the same R: --residual=preln (GPT-2's block with RMSNorm and RoPE).
out_dir = "out-paper-small"
dataset = "fineweb_edu"
wandb_run_name = "paper-small"

n_layer = 12
n_loop = 1  # R: the paper runs 1, 3, 5 and 7
n_head = 12
n_embd = 768
block_size = 1024
dropout = 0.0
residual = "deeploop"
norm = "rmsnorm"
position_encoding = "rope"
norm_branch_input = True

# 12 sequences x 40 micro-batches = 480 sequences (491,520 tokens) per step; 40 is the total over all processes, so
# 1, 2, 4 or 8 GPUs divide it. Activations grow with the unrolled depth 12 * R: when memory runs out, lower
# batch_size and raise gradient_accumulation_steps by the same factor (--batch_size=4
# --gradient_accumulation_steps=120 is the same step).
batch_size = 12
gradient_accumulation_steps = 40

# The paper does not give its optimizer settings; these are GPT-3 small's (Brown et al. 2020, table 2.1): peak
# learning rate 6e-4, cosine decay to 10% of it over the run. Warmup is nanoGPT's GPT-2 recipe (2000 steps, ~1B
# tokens). AdamW betas (0.9, 0.95), weight decay 0.1 and gradient clipping at 1.0 are GPT-3's too, and train.py's
# defaults.
learning_rate = 6e-4
max_iters = 100000
lr_decay_iters = 100000
warmup_iters = 2000
min_lr = 6e-5
