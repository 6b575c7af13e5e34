"""Survey (issue 12): each tiny model of the given families, attributed by block/head/neuron on a padded batch
with a contrast, against a plain transformers forward of each prompt alone; and the plain forward's own padding
safety (the padded batch's logits against each prompt alone). One line per family.

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python notes/fam1_survey.py [family ...]
"""
import sys
import time
import warnings

import torch

import dla_recipes
from dla_recipes.testing import tiny

PROMPTS = ["w5 w6 w7 w8 w9 w10", "w11 w12", "w13 w14 w15 w16"]
TARGET, CONTRAST = "w20", "w21"
warnings.filterwarnings("ignore")


def alone(hf, tok, prompt):
    ids = tok(prompt, return_tensors="pt")
    with torch.no_grad():
        return hf(**ids).logits[0, -1].float()


def padded(hf, tok, prompts):
    from nnsight.modeling.processing import positions

    ids = tok(prompts, return_tensors="pt", padding=True)  # position_ids as nnsight supplies them
    with torch.no_grad():
        return hf(**ids, position_ids=positions(ids["attention_mask"])).logits[:, -1].float()


def survey(key):
    t0 = time.time()
    model = tiny.standardized(key)
    hf, tok = model._module, model.tokenizer
    fam = dla_recipes.family_of(model)
    t, c = tok.convert_tokens_to_ids(TARGET), tok.convert_tokens_to_ids(CONTRAST)
    ref = torch.stack([alone(hf, tok, p) for p in PROMPTS])
    pad = padded(hf, tok, PROMPTS)
    pad_err = float(((pad - ref).abs().max(-1).values / ref.abs().max(-1).values.clamp(min=1)).max())
    want = ref[:, t] - ref[:, c]
    out = []
    for by in ("block", "head", "neuron"):
        try:
            if fam.padding_safe:
                attr = dla_recipes.attribute(model, PROMPTS, TARGET, contrast=CONTRAST, by=by)
                got = attr.output_logit
            else:
                got = torch.cat([dla_recipes.attribute(model, p, TARGET, contrast=CONTRAST, by=by).output_logit
                                 for p in PROMPTS])
            err = float(((got - want).abs() / want.abs().clamp(min=1)).max())
            out.append(f"{by}={'ok' if err < 1e-4 else f'OFF{err:.1e}'}({len(attr.labels) if fam.padding_safe else '-'})")
        except Exception as e:  # noqa: BLE001
            out.append(f"{by}=ERR[{type(e).__name__}: {str(e)[:160]}]")
    print(f"{key:22s} fam={fam.name:14s} declared_safe={fam.padding_safe!s:5s} pad_err={pad_err:.1e} "
          + " ".join(out) + f" {time.time() - t0:.1f}s", flush=True)


for key in sys.argv[1:] or tiny.SHAPED_FAMILIES:
    try:
        survey(key)
    except Exception as e:  # noqa: BLE001
        print(f"{key:22s} LOAD-ERR {type(e).__name__}: {str(e)[:300]}", flush=True)
