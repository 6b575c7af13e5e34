"""The model's own answer, generated and attributed (``attribute_generation``, issue 33), against plain transformers.

The references are the model's own computations, read with plain torch: ``model._module.generate`` (transformers,
no nnsight) with the same settings gives the same ids, its raw per-step logits the runner-up; a plain forward of
each prompt + answer alone (``test_positions.own_logits``) gives the logit each generated step's parts must sum to,
within both forwards' rounding (``test_positions.check_sites``: each site within its own self-check bound and within
twice the logit's rounding, ``bounds.logit_rounding``). An EOS is forced early (``eos_token_id`` set to a token the
tiny model emits), so rows end at different steps and the padded batch has masked steps.
"""

from __future__ import annotations

import pytest
import torch
from conftest import FAST_FAMILIES, PROMPTS, serve_tiny, single_threaded, tiny_model
from test_positions import attribution_bound, batch_ratio, check_sites, ids_of, own_logits

import dla_recipes
from dla_recipes import InputError
from dla_recipes.families import family_of
from dla_recipes.testing import tiny

STEPS = 5
BY = ("head", "block", "neuron")
CASES = [(family, BY[i % len(BY)]) for i, family in enumerate(FAST_FAMILIES)]
TEMPLATE = ("{% for m in messages %}w2 {{ m['content'] }} w3 {% endfor %}{% if add_generation_prompt %}w4{% endif %}")


def padding_safe(model) -> bool:
    return family_of(model._module.config).padding_safe


def plain_generate(model, prompts: list[list[int]], steps: int = STEPS, seed: int | None = None, **options):
    """``(tokens [n][steps], raw logits [n][steps, vocab])``: transformers' own ``generate`` (no nnsight), the prompts
    left-padded in one batch (a padding-unsafe family: each prompt alone, as it is generated there)."""
    groups = [list(range(len(prompts)))] if padding_safe(model) else [[i] for i in range(len(prompts))]
    pad = model.tokenizer.pad_token_id
    tokens, logits = [None] * len(prompts), [None] * len(prompts)
    for group in groups:
        width = max(len(prompts[i]) for i in group)
        ids = torch.tensor([[pad] * (width - len(prompts[i])) + prompts[i] for i in group])
        mask = torch.tensor([[0] * (width - len(prompts[i])) + [1] * len(prompts[i]) for i in group])
        if seed is not None:
            torch.manual_seed(seed)
        with torch.no_grad():
            out = model._module.generate(input_ids=ids, attention_mask=mask, max_new_tokens=steps, output_logits=True,
                                         return_dict_in_generate=True, **options)
        for k, i in enumerate(group):
            tokens[i] = out.sequences[k, width:].tolist()
            logits[i] = torch.stack(out.logits, 1)[k].float()
    return tokens, logits


def cut(tokens: list[int], eos: int) -> list[int]:
    return tokens[:tokens.index(eos) + 1] if eos in tokens else tokens


def emitted_eos(tokens: list[list[int]]) -> int:
    """A token the model emits at a later step of some row and not before it: as EOS it ends that row early (a
    model whose greedy answers repeat one token, tiny gpt2's, ends every row at its first step instead)."""
    for row in tokens:
        for k in range(2, len(row)):
            if row[k] not in row[:k]:
                return row[k]
    return tokens[0][0]


def runner_up(logits: torch.Tensor, tokens: list[int]) -> list[int]:
    """Per step: the most likely token other than the generated one (plain torch on transformers' raw logits)."""
    rest = logits[:len(tokens)].clone()
    rest[torch.arange(len(tokens)), torch.tensor(tokens)] = float("-inf")
    return rest.argmax(-1).tolist()


def reference_of(answers, contrasts, starts):
    """``reference(b, p, z)``: at teacher-forced position ``p`` of row ``b``, the generated token's logit minus its
    contrast's (``z``: the plain forward's logits of prompt + answer alone)."""
    def reference(b, p, z):
        k = p - starts[b]
        return z[p, answers[b][k]] - (z[p, contrasts[b][k]] if contrasts is not None else 0.0)
    return reference


def check_answer(model, attr, prompts, answers, contrasts, what):
    """The teacher-forced sites are the answers' positions, each site's parts the plain forward's logit; the gap to
    the generation's own logit is within the two forwards' rounding and kept in the diagnostics."""
    sequences = [list(p) + list(a) for p, a in zip(prompts, answers)]
    starts = [len(p) - 1 for p in prompts]
    expected = [list(range(s, s + len(a))) for s, a in zip(starts, answers)]
    reference, bound = reference_of(answers, contrasts, starts), attr.diagnostics["bound"]
    if attr.dtype == "float32":
        check_sites(model, attr, sequences, expected, reference, what)
    else:  # check_sites' limit is float32's; in low precision (conftest.own_ratio's model) the teacher-forced
        # batch and the plain forward alone each compute the logit within the self-check's bound: twice it
        for b, sequence in enumerate(sequences):
            z = own_logits(model, sequence)
            assert [int(p) for p in attr.positions[b] if p >= 0] == expected[b], (what, b)
            for k, p in enumerate(expected[b]):
                gap = abs(float(attr.total[b, k].double()) - float(reference(b, p, z)))
                assert gap <= 2 * float(bound[b, k]), (what, b, k, gap, float(bound[b, k]))
    gap = attr.generation.gap
    assert torch.equal(gap.isnan(), ~attr.mask), what
    # Model: the generation (KV cache, one token a step) and the teacher-forced pass each compute the logit within
    # the self-check's bound of its rounding (selfcheck.py), so they differ by at most twice it.
    assert bool((gap[attr.mask].abs() <= 2 * bound[attr.mask]).all()), (what, gap, bound)
    assert torch.equal(attr.diagnostics["generation_gap"].nan_to_num(7.0), gap.nan_to_num(7.0)), what


@pytest.mark.parametrize("family,by", CASES)
def test_answer_is_transformers_generate_and_parts_are_the_plain_forward(family, by):
    """Greedy answers of prompts of 6, 2 and 4 tokens (one padded batch), an EOS forcing rows to end early: the ids
    are transformers' generate's, each step contrasted with transformers' own runner-up, and each generated
    position's parts sum to a plain forward of that prompt + answer alone."""
    model = tiny_model(family)
    prompts = [ids_of(model, p) for p in PROMPTS]
    free, _ = plain_generate(model, prompts)
    eos = emitted_eos(free)
    tokens, logits = plain_generate(model, prompts, eos_token_id=eos)
    answers = [cut(t, eos) for t in tokens]
    assert len({len(a) for a in answers}) > 1 or any(len(a) < STEPS for a in answers), answers  # some row ended
    contrasts = [runner_up(z, a) for z, a in zip(logits, answers)]
    attr = dla_recipes.attribute_generation(model, PROMPTS, STEPS, generate={"eos_token_id": eos},
                                            contrast="runner-up", by=by)
    assert attr.generation.answers == tuple(map(tuple, answers)), (attr.generation.answers, answers)
    assert attr.generation.contrast == "runner-up"
    assert attr.generation.contrast_ids == tuple(map(tuple, contrasts))
    decode = model.tokenizer.decode
    assert attr.target_tokens == tuple(tuple(decode([t]) for t in a) + ("",) * (attr.n_positions - len(a))
                                       for a in answers)
    check_answer(model, attr, prompts, answers, contrasts, f"{family} by {by}")
    # the gap is the generation's own: transformers' raw logits (the same decoding) minus the teacher-forced value;
    # model: gap + output_logit and the raw difference each round a float32 subtraction or two (u = 2^-24 each)
    for b, (z, answer, other) in enumerate(zip(logits, answers, contrasts)):
        k = torch.arange(len(answer))
        own = (z[k, torch.tensor(answer)] - z[k, torch.tensor(other)]).double()
        back = attr.generation.gap[b, :len(answer)].double() + attr.output_logit[b, :len(answer)].double()
        limit = 4 * 2.0 ** -24 * (own.abs() + attr.output_logit[b, :len(answer)].double().abs() + 1e-30)
        assert bool(((back - own).abs() <= limit).all()), (family, b, back, own)
    frame = attr.to_frame()  # one row a (step, component), plus each step's constant and logit
    assert len(frame) == int(attr.mask.sum()) * (len(attr.labels) + 2)


def test_each_step_is_a_single_position_call():
    """Each generated step's parts are what ``attribute`` gives for that one position of prompt + answer alone,
    within both batchings' rounding of the logit (``test_positions.batch_bound``'s model)."""
    model = tiny_model("llama")
    attr = dla_recipes.attribute_generation(model, PROMPTS, 4, contrast="runner-up", by="head")
    for b in range(len(PROMPTS)):
        prompt, answer = ids_of(model, PROMPTS[b]), attr.generation.answers[b]
        sequence = prompt + list(answer)
        for k in (0, len(answer) - 1):
            token, other = answer[k], attr.generation.contrast_ids[b][k]
            alone = dla_recipes.attribute(model, [sequence], token, contrast=other, position=len(prompt) - 1 + k,
                                          by="head")
            limit = attribution_bound(model, alone, lambda _, p, z, t=token, o=other: z[p, t] - z[p, o])
            assert batch_ratio(attr.values[b, k][None], alone.values, limit) <= 1, (b, k)
            assert batch_ratio(attr.logit[b, k][None], alone.logit, limit) <= 1, (b, k)


def test_chat_messages_go_through_the_chat_template():
    """Conversations are rendered by the tokenizer's chat template with the generation prompt; only the generated
    (assistant) tokens are attributed: the result equals the call on the rendered ids, its first site the last
    template token."""
    model = tiny_model("llama")
    chats = [[{"role": "user", "content": "w5 w6 w7"}], [{"role": "system", "content": "w9"},
                                                         {"role": "user", "content": "w11"}]]
    with pytest.raises(InputError, match="no chat template"):
        dla_recipes.attribute_generation(model, chats, 3)
    model.tokenizer.chat_template = TEMPLATE
    try:
        chat = dla_recipes.attribute_generation(model, chats, 3, by="head")
        single = dla_recipes.attribute_generation(model, chats[0], 3, by="head")  # one conversation
        stats = dla_recipes.attribute_dataset(model, [{"chat": c} for c in chats], prompt="chat", by="head",
                                              generate={"max_new_tokens": 3}, reduce="stats")  # a column of them
    finally:
        model.tokenizer.chat_template = None
    rendered = [[2, 5, 6, 7, 3, 4], [2, 9, 3, 2, 11, 3, 4]]  # w2 <content> w3 per message, then w4
    plain = dla_recipes.attribute_generation(model, rendered, 3, by="head")
    assert chat.generation.chat and chat.generation.prompt_lengths == (6, 7)
    assert chat.generation.answers == plain.generation.answers
    assert torch.equal(chat.values.nan_to_num(), plain.values.nan_to_num())
    assert chat.positions[:, 0].tolist() == [5, 6]  # the position after the generation prompt predicts token 0
    assert single.generation.answers == chat.generation.answers[:1]
    assert stats.count == int(chat.mask.sum())
    check_answer(model, chat, rendered, chat.generation.answers, None, "chat")


def test_a_sampled_answer_is_attributed_as_sampled_with_its_seed():
    """``do_sample=True``: the answer is transformers' generate's under the same seed, recorded; a seed drawn for
    the call reproduces it; each sampled token (not always the argmax) is the attributed target."""
    model = tiny_model("llama")
    prompts = [ids_of(model, p) for p in PROMPTS]
    options = {"do_sample": True, "temperature": 2.0, "top_k": 0}
    tokens, logits = plain_generate(model, prompts, seed=11, **options)
    attr = dla_recipes.attribute_generation(model, PROMPTS, STEPS, generate=options, seed=11, contrast="mean")
    assert attr.generation.answers == tuple(map(tuple, tokens)) and attr.generation.settings.seed == 11
    assert any(z[k].argmax() != t for z, row in zip(logits, tokens) for k, t in enumerate(row))  # really sampled
    drawn = dla_recipes.attribute_generation(model, PROMPTS, STEPS, generate=options)
    again = dla_recipes.attribute_generation(model, PROMPTS, STEPS, generate=options, seed=drawn.generation.settings.seed)
    assert again.generation.answers == drawn.generation.answers


def test_bfloat16_parts_are_the_plain_bf16_forward():
    """In bfloat16 the parts sum to the plain bf16 forward's logit within its rounding (``check_sites``' bounds are
    the dtype's), and the generation-vs-teacher-forced gap within twice the self-check's bound."""
    model = dla_recipes.load(tiny.build("llama").to(torch.bfloat16), tokenizer=tiny.tokenizer(), device_map="cpu")
    prompts = [ids_of(model, p) for p in PROMPTS]
    attr = dla_recipes.attribute_generation(model, PROMPTS, 4, contrast="runner-up", by="head")
    assert attr.dtype == "bfloat16"
    check_answer(model, attr, prompts, attr.generation.answers, attr.generation.contrast_ids, "bf16")


def test_contrast_given_per_step_and_reductions():
    """A contrast per step (a list per prompt) is each step's; ``reduce="sum"`` is each answer's steps summed;
    ``reduce="stats"`` (and ``attribute_dataset(generate=..., reduce="stats")``) pools every generated step."""
    model = tiny_model("llama")
    first = dla_recipes.attribute_generation(model, PROMPTS, 3, by="head")
    per_step = [[f"w{30 + k}" for k in range(3)] for _ in PROMPTS]
    given = dla_recipes.attribute_generation(model, PROMPTS, 3, contrast=per_step, by="head")
    assert given.generation.contrast == "given" and given.contrast_tokens[0] == ("w30", "w31", "w32")
    prompts = [ids_of(model, p) for p in PROMPTS]
    check_answer(model, given, prompts, given.generation.answers, [[30, 31, 32]] * 3, "per step")
    summed = dla_recipes.attribute_generation(model, PROMPTS, 3, by="head", reduce="sum")
    assert torch.allclose(summed.values.double(), first.values.double().nansum(1), rtol=0, atol=1e-6)
    stats = dla_recipes.attribute_dataset(model, [{"prompt": p} for p in PROMPTS], generate={"max_new_tokens": 3},
                                          by="head", reduce="stats", batch_size=2)
    summary = stats.summary().loc[list(first.labels)]
    assert int(summary["n"].iloc[0]) == int(first.mask.sum())
    mean = first.values[first.mask].double().mean(0)
    # Model: two float32 sums of the same n values in different orders: each within n * u * sum |v| of the exact
    n, u = int(first.mask.sum()), 2.0 ** -24
    limit = n * u * first.values[first.mask].double().abs().sum(0) / n
    assert bool(((torch.tensor(summary["mean"].to_numpy()) - mean).abs() <= 2 * limit + 1e-12).all())


def test_bad_input_is_named_at_once():
    model = tiny_model("llama")
    chat = [{"role": "user", "content": "w5"}]
    with pytest.raises(InputError) as error:
        dla_recipes.attribute_generation(model, chat, 0, generate={"num_beams": 2, "colour": 3, "temperature": -1.0,
                                                                          "do_sample": True, "max_new_tokens": 4},
                                         position=-1)
    text = str(error.value)
    for part in ("no chat template", "max_new_tokens=0", "num_beams", "'colour'", "temperature",
                 "sets max_new_tokens itself", "position=-1: attribute_generation"):
        assert part in text, (part, text)
    with pytest.raises(InputError, match="transformers refuses"):
        dla_recipes.attribute_generation(model, PROMPTS, 2, generate={"do_sample": False, "temperature": 0.5})
    with pytest.raises(InputError, match="attribute_generation"):
        dla_recipes.attribute(model, PROMPTS, "generated", position=slice(0, 2))
    with pytest.raises(InputError, match="one slice per prompt"):
        dla_recipes.attribute(model, PROMPTS, "next", position=[slice(0, 2)] * 2)
    with pytest.raises(InputError, match="fewer tokens than the answer"):
        dla_recipes.attribute_generation(model, PROMPTS, 3, contrast=[["w30"]] * 3)
    config = model._module.generation_config
    before, config.temperature = config.temperature, 0.6  # a checkpoint's own config that transformers only warns
    try:                                                    # about is not the caller's fault
        assert dla_recipes.attribute_generation(model, PROMPTS[:1], 2).generation.settings.seed is None
    finally:
        config.temperature = before


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serve_tiny(tmp_path_factory.mktemp("served"), ["llama"]) as running:
        yield running


@pytest.mark.server
def test_remote_equals_local(server):
    """On the loopback NDIF server the answer is generated and attributed in ONE request (one session: generate,
    then the teacher-forced trace, server side): the same answers, runner-ups and values as locally, bit for bit
    (both single-threaded); ``reduce="stats"`` (two requests: the generation, then ``attribute``) as locally too."""
    remote_model, local_model = server.remote_model("llama"), server.local_model("llama")
    server.clear_stats()
    with server.client():
        remote = dla_recipes.attribute_generation(remote_model, PROMPTS, 4, contrast="runner-up", by="head",
                                                  remote=True)
    assert [r["status"] for r in server.stats()] == ["COMPLETED"]
    with single_threaded():
        local = dla_recipes.attribute_generation(local_model, PROMPTS, 4, contrast="runner-up", by="head")
    assert remote.generation.answers == local.generation.answers
    assert remote.generation.contrast_ids == local.generation.contrast_ids
    assert torch.equal(remote.values, local.values) and torch.equal(remote.constant, local.constant)
    assert all(p.device.type == "meta" for p in remote_model._module.parameters())
    sampling = {"do_sample": True, "temperature": 2.0}  # seeded on the server, in the session and in the request
    with server.client():
        stats = dla_recipes.attribute_generation(remote_model, PROMPTS, 4, by="head", remote=True, reduce="stats",
                                                 generate=sampling, seed=3)
        sampled = dla_recipes.attribute_generation(remote_model, PROMPTS, 4, remote=True, generate=sampling, seed=3)
    with single_threaded():
        alone = dla_recipes.attribute_generation(local_model, PROMPTS, 4, by="head", reduce="stats",
                                                 generate=sampling, seed=3)
        here = dla_recipes.attribute_generation(local_model, PROMPTS, 4, generate=sampling, seed=3)
    assert sampled.generation.answers == here.generation.answers != local.generation.answers
    assert stats.count == alone.count == int(here.mask.sum()) and torch.equal(stats.mean, alone.mean)


@pytest.mark.server
def test_ndif_like_server_bfloat16_autocast(tmp_path):
    """As NDIF runs a request (bfloat16 weights, sdpa, ``torch.autocast``): remote equals the same model run locally
    under the same bracket, and the parts sum to a plain bf16 forward of prompt + answer under it (twice the
    self-check's bound: two forwards, each within it)."""
    import secrets

    from dla_recipes.testing.loopback import LoopbackServer

    folder = tmp_path / "llama"
    tiny.build("llama").save_pretrained(folder)
    tiny.tokenizer().save_pretrained(folder)
    with LoopbackServer({"llama": str(folder)}, api_key=secrets.token_hex(16), ndif=True,
                        forked=True) as running:
        remote_model, local_model = running.remote_model("llama"), running.local_model("llama", dispatch=True)
        with running.client():
            remote = dla_recipes.attribute_generation(remote_model, PROMPTS, 4, contrast="runner-up", by="head",
                                                      remote=True)
        with single_threaded(), running.bracket():
            local = dla_recipes.attribute_generation(local_model, PROMPTS, 4, contrast="runner-up", by="head")
            assert remote.dtype == "bfloat16"
            assert remote.generation.answers == local.generation.answers
            assert torch.equal(remote.values, local.values)
            prompts = [ids_of(local_model, p) for p in PROMPTS]
            check_answer(local_model, remote, prompts, remote.generation.answers, remote.generation.contrast_ids,
                         "ndif-like")


@pytest.mark.real
@pytest.mark.slow
def test_smollm2_instruct_chat_answer():
    """SmolLM2-135M-Instruct (the default model; its tokenizer has a chat template), two chat prompts: the answers
    are transformers' generate's of the rendered conversations (one ends at its EOS, ``<|im_end|>``), each step
    contrasted with its runner-up, every step's parts the plain forward's logit difference of prompt + answer alone."""
    from dla_recipes import models

    model = dla_recipes.load(models.default_model_path(), dtype=torch.float32, device_map="cpu", dispatch=True)
    chats = [[{"role": "user", "content": "What is the capital of France? Answer in one word."}],
             [{"role": "user", "content": "Name a primary color."}]]
    prompts = [model.tokenizer(model.tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False),
                               add_special_tokens=False)["input_ids"] for c in chats]
    eos = model._module.generation_config.eos_token_id
    tokens, logits = plain_generate(model, prompts, 10)
    answers = [cut(t, eos) for t in tokens]
    attr = dla_recipes.attribute_generation(model, chats, 10, contrast="runner-up", by="head")
    assert attr.generation.answers == tuple(map(tuple, answers)) and attr.generation.chat
    assert any(a[-1] == eos for a in answers) and attr.generation.texts[0].startswith("The capital of France is Paris")
    assert attr.generation.contrast_ids == tuple(tuple(runner_up(z, a)) for z, a in zip(logits, answers))
    check_answer(model, attr, prompts, answers, attr.generation.contrast_ids, "smollm2-instruct")


def test_plots_of_an_answer():
    """The position plots read a ``GenerationAttribution`` as any ``PositionAttribution``: the blocks heatmap, the
    top heads x the answer's steps (``top_components_heatmap``: the largest ``|part|`` summed over the steps, first),
    the per-token text."""
    from dla_recipes import plots

    model = tiny_model("llama")
    attr = dla_recipes.attribute_generation(model, PROMPTS, 4, contrast="runner-up", by="head")
    figure = plots.top_components_heatmap(attr, k=3, kind="head", prompt=1)
    steps = int(attr.mask[1].sum())
    heads = [i for i, label in enumerate(attr.labels) if ".H" in label]
    total = attr.values[1, :steps][:, heads].abs().sum(0)
    assert list(figure.data[0].y) == [attr.labels[heads[i]] for i in total.argsort(descending=True)[:3].tolist()]
    assert len(figure.data[0].x) == steps
    assert len(plots.positions_heatmap(attr, prompt=1).data[0].x) == steps
    text = plots.token_text(attr, component="L0.attn", prompt=1)
    assert int((~text.values.isnan()).sum()) == steps
    with pytest.raises(InputError, match="kind="):
        plots.top_components_heatmap(attr, kind="heads")
    picked = attr[[2, 0]]  # selecting prompts keeps their answers and gaps
    assert picked.generation.answers == (attr.generation.answers[2], attr.generation.answers[0])
    assert torch.equal(picked.values.nan_to_num(), attr.values[[2, 0]].nan_to_num())
    assert torch.equal(picked.generation.gap.nan_to_num(), attr.generation.gap[[2, 0]].nan_to_num())


@pytest.mark.server
def test_remote_steered_generation_with_the_add_check_equals_local(server):
    """Through the one session loop (``generation.session.send_generation``): a steering edit made at every
    generation step and in the teacher-forced trace, with the per-add check, gives on the loopback NDIF server the
    answers and values it gives locally, bit for bit (both single-threaded); the edit changed the answers."""
    remote_model, local_model = server.remote_model("llama"), server.local_model("llama")
    vector = torch.linspace(-3.0, 3.0, local_model.config.hidden_size)

    def steer(model, vector=vector):
        model.layers[1].mlp.output = model.layers[1].mlp.output + vector

    options = {"contrast": "runner-up", "by": "head", "check": "adds"}
    with server.client():
        remote = dla_recipes.attribute_generation(remote_model, PROMPTS, 4, intervene=steer, remote=True, **options)
    with single_threaded():
        local = dla_recipes.attribute_generation(local_model, PROMPTS, 4, intervene=steer, **options)
        plain = dla_recipes.attribute_generation(local_model, PROMPTS, 4, **options)
    assert remote.generation.answers == local.generation.answers != plain.generation.answers
    assert torch.equal(remote.values, local.values) and torch.equal(remote.constant, local.constant)
    assert "L1.mlp" in remote.labels or any(label.startswith("L1.mlp") for label in remote.labels)
