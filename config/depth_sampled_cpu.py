# The depth task (config/depth_cpu.py) trained for adaptive exit: each step draws its loop count uniformly from 2..6
# (mean 4, the fixed config's count; no 1-loop steps, which teach nothing about the longer chains), so that the
# model works at every loop count up to 8 and its answers settle as the loops go on. A cell k pointers from its
# value needs about k loops; adaptive exit (depth_eval.py --exit_thresholds) should spend few on k = 1 and many on
# k = 6. Measurements: docs/test_time_depth.md.
#   python -m lab.train config/depth_sampled_cpu.py
#   python -m lab.depth_eval --out_dir=out-depth-sampled --loops=1,2,4,8 --exit_thresholds=1e-3,1e-2,1e-1
out_dir = "out-depth-sampled"
dataset = "chains"
chain_values = 8
chain_hops = 6
device = "cpu"
dtype = "float32"  # a model this small is bound by per-operation overhead (see config/smoke_cpu.py)
compile = False

n_layer = 2
n_loop = 4  # the loop count of evaluations; Pre-LN has no alpha or beta to build from it
loop_sampling = "uniform"
loop_min = 2
loop_max = 6
eval_loops = "1,2,4,6,8"
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

eval_interval = 500
eval_iters = 10
log_interval = 100
