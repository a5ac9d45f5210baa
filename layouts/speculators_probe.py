"""Run inside the speculators venv by draftsmith consumer-check (draftsmith.layouts.consumer_check): load an export with speculators' API.

    python speculators_probe.py EXPORT_DIR INPUTS.safetensors OUT_DIR

Imports nothing from draftsmith (the venv has speculators' own torch and transformers). Writes
OUT_DIR/report.json (missing, unexpected, uninitialised and mismatched weight names, the
verifier weights that differ from the verifier's checkpoint, the dtype it computed in) and
OUT_DIR/logits.st: the step-0 draft logits of ``Eagle3DraftModel.forward`` on the given features
and token ids, caught at its ``lm_head``.
"""

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def main(export_dir: str, inputs_path: str, out_dir: str) -> None:
    from speculators import SpeculatorModel

    model = SpeculatorModel.from_pretrained(export_dir)
    model.eval()
    saved = load_file(str(Path(export_dir) / "model.safetensors"))
    state = model.state_dict()
    from_verifier = {"verifier_lm_head.weight", "verifier_norm.weight"}
    report = {
        "class": type(model).__name__,
        "missing": sorted(set(state) - set(saved) - from_verifier),
        "unexpected": sorted(set(saved) - set(state)),
        "uninitialised": sorted(k for k, v in state.items()
                                if v.is_floating_point() and not bool(torch.isfinite(v).all())),
        "mismatched": sorted(k for k in set(saved) & set(state)
                             if saved[k].shape != state[k].shape
                             or not torch.equal(saved[k].to(state[k].dtype), state[k])),
    }
    inputs = load_file(inputs_path)
    features, input_ids = inputs["features"], inputs["input_ids"]
    dtype = model.fc.weight.dtype
    report["dtype"] = str(dtype).removeprefix("torch.")  # what the logits were computed in
    caught = []
    hook = model.lm_head.register_forward_hook(lambda mod, args, out: caught.append(out.detach()))
    positions = torch.arange(input_ids.shape[1])[None]
    with torch.no_grad():
        model(hidden_states=features.to(dtype), input_ids=input_ids,
              document_ids=torch.zeros_like(input_ids), position_ids=positions, ttt_steps=1)
    hook.remove()
    save_file({"logits": caught[0].float().contiguous()}, str(Path(out_dir) / "logits.st"))
    (Path(out_dir) / "report.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main(*sys.argv[1:4])
