"""The console commands pip installs (``pretrain-train``, ``pretrain-eval-ppl``, ...): each runs its script in
``launch/`` or ``tools/`` exactly as ``python SCRIPT`` does, arguments and exit status included.

The scripts stay where a reader of the checkout looks for them, and ``python tools/eval_ppl.py`` keeps working;
the commands need the checkout beside the package, which the editable install (``pip install -e .``) gives.
"""
import runpy
import sys
from collections.abc import Callable
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parent.parent


def _command(script: str) -> Callable[[], None]:
    def run() -> None:
        path = CHECKOUT / script
        if not path.is_file():
            raise SystemExit(f"{path} not found: the pretrain-* commands run the scripts of a checkout; install it "
                             f"with pip install -e . (or run python {script} there)")
        sys.argv[0] = str(path)
        sys.path.insert(0, str(path.parent))  # as python puts the script's directory first: tools import siblings
        runpy.run_path(str(path), run_name="__main__")

    run.__doc__ = f"python {script} ..."
    return run


train = _command("launch/pretrain.py")
torchrun = _command("launch/torchrun.py")
eval_ppl = _command("tools/eval_ppl.py")
eval_cls = _command("tools/eval_cls.py")
generate = _command("tools/generate.py")
make_shards = _command("tools/make_shards.py")
train_tokenizer = _command("tools/train_tokenizer.py")
compare_mixers = _command("tools/compare_mixers.py")
export = _command("tools/export.py")
reshard = _command("tools/reshard.py")
profile_step = _command("tools/profile_step.py")
