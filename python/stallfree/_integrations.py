"""ZenFlowAdamW's integration with the libraries that drive it: which library is calling (a
Hugging Face Trainer among the callers, accelerate's save_state) and the Trainer callback that
consolidates the state before its checkpoints. torch's private APIs are _torch_private.py's."""
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


def _called_from_torch_state_dict():
    """Whether torch's distributed state-dict API is asking (by its public names), which wants
    the state in its distributed form (_rows.py): "set" from set_optimizer_state_dict /
    set_state_dict (its template for a full state dict), "get" from get_optimizer_state_dict /
    get_state_dict, else None."""
    module = "torch.distributed.checkpoint.state_dict"
    if _called_from(module, "set_optimizer_state_dict") or _called_from(module, "set_state_dict"):
        return "set"
    if _called_from(module, "get_optimizer_state_dict") or _called_from(module, "get_state_dict"):
        return "get"
    return None


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

