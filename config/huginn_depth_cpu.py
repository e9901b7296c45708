# The depth task (config/depth_cpu.py) in Huginn's shape (Geiping et al. 2025): a prelude block run once, a core of 2
# blocks looped 3 times, a coda block run once (unrolled depth 1 + 2 x 3 + 1 = 8, depth_cpu's 2 x 4), and the
# prelude's output fed into every loop through Huginn's adapter on [state, input] (model.LoopInput, [I | 0] at init):
# every loop reads the cells' tokens again. The same steps and depth as depth_cpu. Took 1 min 45 s on 2 quiet cores.
#   python -m lab.train config/huginn_depth_cpu.py
#   python -m lab.train config/huginn_depth_cpu.py --residual=deeploop    # Post-LN blocks, which fail depth_cpu looped
#   python -m lab.train config/huginn_depth_cpu.py --loop_input=none      # without the injection
#   python -m lab.depth_eval --out_dir=out-huginn-depth --loops=1,2,3,6   # test-time depth counts core loops
out_dir = "out-huginn-depth"
dataset = "chains"
chain_values = 8
chain_hops = 6
device = "cpu"
dtype = "float32"  # a model this small is bound by per-operation overhead (see config/smoke_cpu.py)
compile = False

n_prelude = 1
n_layer = 2  # the looped core
n_loop = 3
n_coda = 1
loop_input = "concat"
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
