"""The offline switches. huggingface_hub/transformers read them at import time, so they must be
in every worker's environment from exec; the plan adds the profile's env to the
launcher's own, and this checks the union."""

from __future__ import annotations

from v4flash_pd.doctor.context import DoctorInput
from v4flash_pd.doctor.result import Check, ok, warn

REQUIRED = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
TRUTHY = ("1", "true", "yes", "on")


def run(inp: DoctorInput) -> list[Check]:
    env = {**inp.probe.env, **inp.expect.worker_env}
    unset = [k for k in REQUIRED if env.get(k, "").strip().lower() not in TRUTHY]
    notes = []
    if env.get("HF_TOKEN") or env.get("HUGGING_FACE_HUB_TOKEN"):
        notes.append("an HF token is set (not needed offline)")
    if unset:
        return [warn("offline-env", f"not set to 1 for the workers: {', '.join(unset)}"
                     + (f"; {notes[0]}" if notes else ""),
                     "add them to the config's [env] table (the default profiles do) or export "
                     + " ".join(f"{k}=1" for k in unset) + "; without them a tokenizer/config lookup may try "
                     "the network and hang or fail on an air-gapped box")]
    return [ok("offline-env", ", ".join(f"{k}=1" for k in REQUIRED) + (f" ({notes[0]})" if notes else ""))]
