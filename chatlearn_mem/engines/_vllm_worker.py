"""Functions the vLLM rollout runs inside the engine's worker (``collective_rpc``). A worker may
import this module anew, so it has no side effects on import and imports nothing heavy."""


def refresh_tied_head(worker) -> str:
    """Rebuild a tied language-model head's kernel weights from the updated embedding.

    With tied embeddings the head shares the embedding's parameter, so an update writes both; but
    on the CPU build the head's matrix product runs on a packed copy made when the layer was
    processed (``process_weights_after_loading``). vLLM's in-place reload (``reload_weights``,
    checkpoint format, 0.32) processes a layer once all its weights arrived, and a tied head
    receives none, so it kept sampling from the previous weights' head (found by the PPO run's
    check: 0.19 off the policy after the first update). Returns ``"refreshed"`` or ``"no head"``.
    """
    model = worker.model_runner.model
    head = getattr(model, "lm_head", None)
    method = getattr(head, "quant_method", None)
    if head is None or method is None:
        return "no head"
    method.process_weights_after_loading(head)
    return "refreshed"
