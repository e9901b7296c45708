# A two-minute run on a laptop-class CPU (2 cores): a tiny looped model on the builtin corpus (Python's own
# documentation, prepared offline on first use) as UTF-8 bytes. Bytes, not GPT-2 tokens: with GPT-2's 50K vocabulary
# nearly all of a CPU step goes to the output layer, and in two minutes the model learns little beyond word
# frequencies; on bytes it takes ~0.07 s a step and learns to spell. Val loss starts at ln(320) ~ 5.8.
#   python train.py config/smoke_cpu.py
#   python train.py config/smoke_cpu.py --init_from=resume --max_iters=1800    # carry on from out-smoke/ckpt.pt
#   python train.py config/smoke_cpu.py --dataset=builtin --max_iters=150      # GPT-2 tokens instead (~0.5 s a step)
out_dir = "out-smoke"
dataset = "builtin_bytes"
device = "cpu"
# float32, not "auto": a model this small is bound by per-operation overhead, and bfloat16's casts made it slower
# (bench.py with this model: 0.71x the tokens/s of float32, and 1.4x the CPU time)
dtype = "float32"
compile = False  # compiling would take longer than the whole run

n_layer = 2
n_loop = 2  # unrolled depth 4
n_head = 4
n_embd = 128
block_size = 128
batch_size = 16
gradient_accumulation_steps = 1  # 2,048 tokens per step

learning_rate = 1e-3
max_iters = 1200
lr_decay_iters = 1800  # beyond max_iters, so that the resume command above continues the same schedule
warmup_iters = 100  # Post-LN blocks need a real warmup: with 20-30 steps this model stalls at unigram statistics
min_lr = 1e-4

eval_interval = 300
eval_iters = 20
log_interval = 50
