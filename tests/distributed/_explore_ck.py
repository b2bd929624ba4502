import faulthandler, functools, sys, signal, time
faulthandler.dump_traceback_later(300, exit=True)
from tridist import distcore
from tests.distributed import transformers_worker as w
distcore.init_parallel_env()
for name in sys.argv[1:]:
    t = time.time()
    try:
        w._train("llama", w.MATRIX[name], prepare=functools.partial(w._hf_checkpointing, use_reentrant=True))
        print("OK", name, time.time() - t, flush=True)
    except Exception as e:
        print("FAIL", name, type(e).__name__, str(e)[:600], flush=True)
