"""Where ZenFlowAdamW reaches into torch's and other libraries' internals, in one place: which
library is calling (a Hugging Face Trainer among the callers, accelerate's save_state), the
Trainer callback that consolidates the state before its checkpoints, and taking torch's
optimizer hooks off for the duration of a call (the optimizer's private hook dictionaries,
torch >= 2.0)."""
import collections
import contextlib
import sys
import weakref

def _called_from(module, function):
    """Whether a caller's frame runs `function` of `module` (a library calling the optimizer
    from a place where every rank calls it: accelerate's save_state)."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name == function and frame.f_globals.get("__name__") == module:
            return True
        frame = frame.f_back
    return False


def _calling_trainer():
    """The Hugging Face Trainer among the callers (its methods run the training loop that
    calls step() and backward()), or None."""
    module = sys.modules.get("transformers.trainer")
    if module is None:
        return None
    frame = sys._getframe(2)
    while frame is not None:
        if isinstance(frame.f_locals.get("self"), module.Trainer):
            return frame.f_locals["self"]
        frame = frame.f_back
    return None


def _consolidating_callback(opt):
    """The Hugging Face TrainerCallback of _follow_trainer: before a checkpoint (the Trainer's
    control.should_save after a step or an epoch; with save_strategy "best", after each
    evaluation, which decides it) the ranks consolidate the optimizer's state on the saving
    rank (every rank with save_on_each_node)."""
    from transformers import TrainerCallback

    class ConsolidateBeforeSave(TrainerCallback):
        def __init__(self):
            self.opt = weakref.ref(opt)

        def _consolidate(self, args, when):
            o = self.opt()
            if o is not None and not o._closed and when:
                o.consolidate_state_dict(to=None if args.save_on_each_node else 0)

        def on_step_end(self, args, state, control, **kwargs):
            self._consolidate(args, control.should_save)

        def on_epoch_end(self, args, state, control, **kwargs):
            self._consolidate(args, control.should_save)

        def on_evaluate(self, args, state, control, **kwargs):
            self._consolidate(args, str(getattr(args.save_strategy, "value",
                                                args.save_strategy)) == "best")

    return ConsolidateBeforeSave()


@contextlib.contextmanager
def _hooks_held(opt, attr):
    """Takes torch's hooks of `attr` off `opt` for the duration (yielding them), so that
    ZenFlowAdamW runs them itself at the point where the state they see is whole."""
    hooks = getattr(opt, attr)
    setattr(opt, attr, collections.OrderedDict())
    try:
        yield hooks
    finally:
        hooks.update(getattr(opt, attr))  # registered meanwhile (by a hook): kept, and run
        setattr(opt, attr, hooks)
