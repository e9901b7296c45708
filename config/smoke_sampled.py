# The smoke run (config/smoke_cpu.py) trained for test-time depth: each step draws its loop count from Huginn's
# log-normal Poisson distribution with mean 2 (model.TrainLoops), so that the model works at other loop counts than
# the 2 it evaluates at. The same compute as smoke_cpu: the same steps at the same mean loop count. Each evaluation
# also reports val loss at 1, 2 and 4 loops (metrics.jsonl, plot.py; --eval_loops=1,2,3,4,5,6,7,8 for more, at more
# evaluation time). Measurements: docs/test_time_depth.md.
#   python -m lab.train config/smoke_sampled.py
#   python sample.py --out_dir=out-smoke-sampled --start="The " --n_loop=4
out_dir = "out-smoke-sampled"
dataset = "builtin_bytes"
device = "cpu"
dtype = "float32"  # as smoke_cpu: bfloat16's casts make a model this small slower
compile = False

n_layer = 2
n_loop = 2  # the loop count of evaluations and sample.py; alpha and beta come from it (unrolled depth 4)
loop_sampling = "lognormal_poisson"
loop_mean = 2.0
n_head = 4
n_embd = 128
block_size = 128
batch_size = 16
gradient_accumulation_steps = 1

learning_rate = 1e-3
max_iters = 1200
lr_decay_iters = 1800
warmup_iters = 100
min_lr = 1e-4

eval_interval = 300
eval_iters = 20
log_interval = 50
