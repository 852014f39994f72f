import copy, sys, torch
sys.path.insert(0, ".")
import moecomp
from tests.generate.models import prompts
from tests.generate.test_sliding_window import build, _gen
ref = build("gpt_oss", "cuda")
opt = moecomp.optimize(copy.deepcopy(ref))
ids, mask = prompts(ref.config.vocab_size, 3, 12, seed=7, left_pad=(0, 3, 5))
out = _gen(opt, ids.cuda(), mask.cuda(), 4)
eng = opt.generate.engine
print(opt.generate.last)
tb = eng.compile_traceback or "none"
lines = tb.splitlines()
print("\n".join(l for l in lines if "File \"/" in l and ("moecomp" in l or "transformers" in l))[-4000:])
print("\n".join(lines[-60:]))
