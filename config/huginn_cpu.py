# The smoke run (config/smoke_cpu.py) in Huginn's shape (Geiping et al. 2025): a prelude block run once, a core of 2
# blocks looped twice, a coda block run once (unrolled depth 1 + 2 x 2 + 1 = 6), and the prelude's output fed into
# every loop through Huginn's adapter on [state, input] (model.LoopInput, [I | 0] at init). 800 steps: the block
# visits of smoke_cpu's 1,200 steps at depth 4. Took 2 min 11 s on 2 quiet cores.
#   python train.py config/huginn_cpu.py
#   python train.py config/huginn_cpu.py --loop_input=none         # the same blocks without the injection
#   python train.py config/huginn_cpu.py --loop_input=add          # Yang et al.'s x + e instead of the adapter
#   python train.py config/huginn_cpu.py --residual=preln          # Pre-LN blocks (Huginn's are Pre-LN-like)
out_dir = "out-huginn"
dataset = "builtin_bytes"
device = "cpu"
dtype = "float32"  # as smoke_cpu: bfloat16's casts make a model this small slower
compile = False

n_prelude = 1
n_layer = 2  # the looped core
n_loop = 2
n_coda = 1
loop_input = "concat"
n_head = 4
n_embd = 128
block_size = 128
batch_size = 16
gradient_accumulation_steps = 1  # 2,048 tokens per step

learning_rate = 1e-3
max_iters = 800
lr_decay_iters = 1200  # as smoke_cpu: 1.5 x max_iters
warmup_iters = 100  # Post-LN blocks need a real warmup (see config/smoke_cpu.py)
min_lr = 1e-4

eval_interval = 200
eval_iters = 20
log_interval = 50
