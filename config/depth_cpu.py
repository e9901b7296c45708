# Depth you can see on a laptop: a looped model on pointer chains (tasks.py), where an answer k pointers away needs
# about k sequential steps, so loops pay. Each evaluation logs the val accuracy by k (metrics.jsonl: "accuracy"),
# next to the best shortcut that does not follow the chains (printed at the start; metrics.jsonl: "shortcuts").
#   python -m lab.train config/depth_cpu.py
#   python -m lab.train config/depth_cpu.py --n_loop=1                 # the same two blocks, run once: fails at larger k
#   python -m lab.train config/depth_cpu.py --n_layer=8 --n_loop=1     # the untied control: 4x the parameters
out_dir = "out-depth"
dataset = "chains"
chain_values = 8
chain_hops = 6  # with pointer doubling two blocks can follow up to 4 pointers; k = 5 and 6 need more depth
device = "cpu"
dtype = "float32"  # a model this small is bound by per-operation overhead (see config/smoke_cpu.py)
compile = False

n_layer = 2
n_loop = 4  # unrolled depth 8
n_head = 4
n_embd = 64
block_size = 16  # cells per sequence
batch_size = 64
gradient_accumulation_steps = 1
residual = "preln"

learning_rate = 3e-3
max_iters = 1500
lr_decay_iters = 1500
warmup_iters = 100
min_lr = 3e-4

eval_interval = 250
eval_iters = 10
log_interval = 50
