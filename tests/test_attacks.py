"""Attack registry, ART/AutoAttack adapter and the adversarial set store, on a tiny seeded network
and real Fashion-MNIST test images."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from detector import networks
from detector.errors import ArtefactError, ConfigError, DataNotFoundError, InputError
from detector.networks import InputSpec, NetworkConfig, build_network
from training.attacks.registry import (
    OVERSHOOTS,
    AttackRunner,
    attack_defaults,
    clear_of_boundary,
    generate,
    list_attacks,
    make_attack_params,
    predict_labels,
)
from training.attacks.sets import get_or_generate, load_adversarial_set, network_sha256, set_key
from training.cli.main import main
from training.data.datasets import default_root, load_dataset, to_arrays

ATTACKS = [
    "fgm",
    "apgd",
    "bim",
    "cw",
    "deepfool",
    "hsj",
    "boundary",
    "autoattack",
    "noise",
    "cw-batched",
    "deepfool-batched",
    "apgd-batched",
]
# Tiny iteration counts: the invariants do not depend on how hard an attack tries.
TINY: dict[str, dict] = {
    "fgm": {},
    "apgd": {"max_iter": 5},
    "bim": {"max_iter": 3},
    "cw": {"max_iter": 3, "binary_search_steps": 2, "max_halving": 1, "max_doubling": 1},
    "deepfool": {"max_iter": 5},
    "hsj": {"max_iter": 2, "max_eval": 50, "init_eval": 10, "init_size": 20},
    "boundary": {"max_iter": 20, "num_trial": 5, "sample_size": 5, "init_size": 20},
    "autoattack": {"n_iter": 2, "n_queries": 20, "n_target_classes": 2},
    "noise": {},
    "cw-batched": {"max_iter": 3, "binary_search_steps": 2, "max_halving": 1, "max_doubling": 1},
    "deepfool-batched": {"max_iter": 5, "nb_grads": 3},
    "apgd-batched": {"max_iter": 5},
}


def _config() -> NetworkConfig:
    return NetworkConfig(
        architecture="resnet9_mnist",
        arguments={"width": 4, "depth": 2, "hidden": 8},
        class_names=[f"c{i}" for i in range(10)],
        input_spec=InputSpec(channels=1, height=28, width=28, mean=[0.5], std=[0.5]),
    )


@pytest.fixture(scope="module")
def data_root() -> Path:
    root = default_root()
    try:
        load_dataset("fashion-mnist", "test", root=root)
    except DataNotFoundError as error:
        pytest.skip(f"Fashion-MNIST not laid out ({error}); run `make data`")
    return root


@pytest.fixture(scope="module")
def images(data_root: Path) -> tuple[np.ndarray, np.ndarray]:
    return to_arrays(load_dataset("fashion-mnist", "test", root=data_root), 6, seed=0)


@pytest.fixture(scope="module")
def network(data_root: Path) -> networks.ObservableResNet:
    """A tiny network, seeded and trained for a few steps so that attacks have something to flip."""
    torch.manual_seed(0)
    model = build_network(_config())
    x, y = to_arrays(load_dataset("fashion-mnist", "train", root=data_root), 512, seed=1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model.train()
    for start in range(0, 512, 64):
        xb, yb = torch.from_numpy(x[start : start + 64]), torch.from_numpy(y[start : start + 64])
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(xb), yb).backward()
        optimizer.step()
    return model.eval()


@pytest.fixture()
def network_dir(network: networks.ObservableResNet, tmp_path: Path) -> Path:
    return networks.save(network, tmp_path / "net")


def _set(cache: Path, network, images, attack: str, params: dict | None = None, **kwargs):
    x, y = images
    n = kwargs.pop("n", 3)
    return get_or_generate(
        cache,
        network,
        x[:n],
        y[:n],
        np.arange(n),
        attack,
        params,
        device="cpu",
        progress=False,
        **kwargs,
    )


# --------------------------------------------------------------------------------------------
# Registry and parameters
# --------------------------------------------------------------------------------------------
def test_registry_holds_the_seed_attacks_with_their_defaults() -> None:
    assert list_attacks() == ATTACKS
    assert attack_defaults("fgm") == {"eps": 0.03, "norm": "Linf"}
    apgd = attack_defaults("apgd")
    assert (apgd["eps"], apgd["max_iter"], apgd["nb_random_init"], apgd["eps_step"]) == (
        0.03,
        100,
        1,
        0.06,
    )
    assert attack_defaults("bim")["eps"] == 0.03
    assert attack_defaults("cw")["max_iter"] == 10
    assert attack_defaults("deepfool")["max_iter"] == 100
    assert attack_defaults("hsj")["max_iter"] == 50 and attack_defaults("hsj")["norm"] == "L2"
    assert attack_defaults("boundary")["max_iter"] == 5000
    aa = attack_defaults("autoattack")
    assert (aa["eps"], aa["norm"], aa["version"]) == (0.03, "Linf", "standard")
    assert attack_defaults("noise") == {"eps": 0.03}


def test_overrides_are_validated_and_steps_follow_eps() -> None:
    assert make_attack_params("bim", {"eps": 0.1}).eps_step == pytest.approx(0.01)
    assert make_attack_params("apgd", {"eps": 0.1}).eps_step == pytest.approx(0.2)
    assert make_attack_params("apgd", {"eps": 0.1, "eps_step": 0.05}).eps_step == 0.05
    with pytest.raises(ConfigError, match="unknown attack 'pgd'"):
        make_attack_params("pgd")
    for eps in (0, -0.1):
        with pytest.raises(ConfigError, match="eps"):
            make_attack_params("fgm", {"eps": eps})
    with pytest.raises(ConfigError, match="unknown parameter.*eps.*'cw'"):
        make_attack_params("cw", {"eps": 0.1})
    with pytest.raises(ConfigError, match="max_iter"):
        make_attack_params("bim", {"max_iter": "many"})
    with pytest.raises(ConfigError, match="custom"):
        make_attack_params("autoattack", {"attacks": ["apgd-ce"]})


def test_bad_requests_fail_before_anything_is_written(network, images, tmp_path: Path) -> None:
    x, y = images
    with pytest.raises(ConfigError):
        get_or_generate(tmp_path / "c", network, x, y, np.arange(len(x)), "nope", device="cpu")
    with pytest.raises(ConfigError):
        get_or_generate(
            tmp_path / "c", network, x, y, np.arange(len(x)), "fgm", {"eps": 0.0}, device="cpu"
        )
    with pytest.raises(InputError):
        generate(network, x[:, :, :20], y, "fgm", device="cpu", progress=False)
    with pytest.raises(InputError):
        generate(network, x + 2.0, y, "fgm", device="cpu", progress=False)
    assert not (tmp_path / "c").exists()


# --------------------------------------------------------------------------------------------
# Every attack: invariants and the cache
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("attack", ATTACKS)
def test_attack_invariants_and_cache(attack: str, network, images, tmp_path: Path) -> None:
    x, y = images[0][:3], images[1][:3]
    params = make_attack_params(attack, TINY[attack])
    adv = _set(tmp_path, network, images, attack, TINY[attack])

    assert adv.x_adv.shape == x.shape and adv.x_adv.dtype == np.float32
    assert adv.x_adv.min() >= 0.0 and adv.x_adv.max() <= 1.0
    bound = params.linf_bound()
    if bound is not None:
        assert np.abs(adv.x_adv - x).max() <= bound + 1e-6
    np.testing.assert_array_equal(adv.adv_pred, predict_labels(network, adv.x_adv, device="cpu"))
    np.testing.assert_array_equal(adv.clean_pred, predict_labels(network, x, device="cpu"))
    np.testing.assert_array_equal(adv.success, adv.adv_pred != y)
    np.testing.assert_array_equal(adv.labels, y)
    np.testing.assert_array_equal(adv.indices, np.arange(3))
    delta = (adv.x_adv.astype(np.float64) - x).reshape(3, -1)
    np.testing.assert_allclose(adv.linf, np.abs(delta).max(1), atol=1e-6)
    np.testing.assert_allclose(adv.l2, np.linalg.norm(delta, axis=1), atol=1e-5)
    assert adv.manifest["params"] == params.model_dump(mode="json") and adv.manifest["n"] == 3
    assert not adv.from_cache and adv.path is not None and adv.path.name.startswith(f"{attack}-")
    assert adv.manifest["seconds_per_image"] == pytest.approx(adv.manifest["batch_seconds"] / 3)
    assert 0 < adv.manifest["batch_seconds"] <= adv.manifest["wall_seconds"]

    # The same request loads the stored set: no batch is generated again.
    generated: list[int] = []
    again = _set(
        tmp_path, network, images, attack, TINY[attack], on_batch=lambda b, n: generated.append(b)
    )
    assert again.from_cache and generated == [] and again.path == adv.path
    assert again.manifest["created"] == adv.manifest["created"]
    np.testing.assert_array_equal(again.x_adv, adv.x_adv)

    # generate() with the same seed and batch size gives the stored set.
    direct = generate(
        network,
        x,
        y,
        attack,
        TINY[attack],
        batch_size=adv.manifest["batch_size"],
        device="cpu",
        progress=False,
    )
    np.testing.assert_array_equal(direct, adv.x_adv)


@pytest.mark.parametrize(
    ("art", "batched", "params"),
    [
        ("cw", "cw-batched", {"binary_search_steps": 2, "max_iter": 5, "initial_const": 10.0}),
        ("deepfool", "deepfool-batched", {"max_iter": 10}),
        ("deepfool", "deepfool-batched", {"max_iter": 10, "epsilon": 0.02}),
    ],
)
def test_batched_minimal_attacks_match_art_on_the_same_images(
    art: str, batched: str, params: dict, network, data_root: Path
) -> None:
    """The batched torch code follows ART's algorithm: on the same images it fools the network as
    often, with the same distances, returns valid images and is deterministic."""
    x, y = to_arrays(load_dataset("fashion-mnist", "test", root=data_root), 24, seed=2)
    clean = predict_labels(network, x, device="cpu")
    results = {}
    for name in (art, batched):
        adv = generate(network, x, y, name, params, batch_size=12, device="cpu", progress=False)
        assert adv.shape == x.shape and adv.dtype == np.float32
        assert adv.min() >= 0.0 and adv.max() <= 1.0
        l2 = np.linalg.norm((adv - x).reshape(len(x), -1), axis=1)
        # Fooled: an originally correct image now misclassified.
        fooled = (clean == y) & (predict_labels(network, adv, device="cpu") != y)
        results[name] = (fooled, l2, adv)
    (art_fooled, art_l2, art_adv), (fooled, l2, adv) = results[art], results[batched]
    # DeepFool's overshoot 1e-6 leaves images on the boundary, where float noise decides the
    # class: compare rates with a little slack, and distances and images closely.
    assert fooled.sum() >= 4 and abs(int(fooled.sum()) - int(art_fooled.sum())) <= 1
    np.testing.assert_allclose(l2, art_l2, rtol=1e-3, atol=1e-4)
    np.testing.assert_allclose(adv, art_adv, atol=1e-4)
    again = generate(network, x, y, batched, params, batch_size=12, device="cpu", progress=False)
    np.testing.assert_array_equal(again, adv)


@pytest.mark.parametrize("eps", [0.03, 0.1])
def test_batched_apgd_follows_art_from_the_same_start(
    eps: float, network, data_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """From the same (zero) random start, APGD as batched torch code takes ART's steps: the same
    checkpoints, step halvings, returns to the best point and momentum, hence the same images
    (the loss of each iterate comes from the pass that gives its gradient, not a second one)."""
    import art.attacks.evasion.auto_projected_gradient_descent as art_apgd

    x, y = to_arrays(load_dataset("fashion-mnist", "test", root=data_root), 24, seed=2)
    monkeypatch.setattr(art_apgd, "random_sphere", lambda n, m, *_: np.zeros((n, m)))
    monkeypatch.setattr(torch, "rand", lambda shape, **kw: torch.full(shape, 0.5, **kw))
    params = {"eps": eps, "max_iter": 30, "nb_random_init": 2}
    art, ours = (
        generate(network, x, y, name, params, batch_size=12, device="cpu", progress=False)
        for name in ("apgd", "apgd-batched")
    )
    clean = predict_labels(network, x, device="cpu")
    fooled = (clean == y) & (predict_labels(network, ours, device="cpu") != y)
    assert fooled.sum() >= 3
    np.testing.assert_allclose(ours, art, atol=1e-5)


def test_batched_apgd_matches_art_from_random_starts(network, data_root: Path) -> None:
    """With their own random starts, ART's APGD and the batched code fool the network as often,
    at the same distances (here 11 of 48 images each, median L2 1.19), within ε; the batched set
    is the same for the same seed."""
    x, y = to_arrays(load_dataset("fashion-mnist", "test", root=data_root), 48, seed=3)
    clean = predict_labels(network, x, device="cpu")
    params = {"eps": 0.05, "max_iter": 30}
    results = {}
    for name in ("apgd", "apgd-batched"):
        adv = generate(network, x, y, name, params, batch_size=24, device="cpu", progress=False)
        assert np.abs(adv - x).max() <= 0.05 + 1e-6
        fooled = (clean == y) & (predict_labels(network, adv, device="cpu") != y)
        l2 = np.linalg.norm((adv - x).reshape(len(x), -1), axis=1)
        results[name] = (int(fooled.sum()), float(np.median(l2[fooled])), adv)
    (art_fooled, art_l2, _), (fooled, l2, adv) = results["apgd"], results["apgd-batched"]
    assert fooled >= 10 and abs(fooled - art_fooled) <= 3
    assert l2 == pytest.approx(art_l2, rel=0.15)
    again = generate(
        network, x, y, "apgd-batched", params, batch_size=24, device="cpu", progress=False
    )
    np.testing.assert_array_equal(again, adv)


def test_batched_deepfool_with_few_candidates_works_per_image(network, data_root: Path) -> None:
    """With ``nb_grads`` below the number of classes, each image is pushed towards the nearest
    boundary among its own most likely classes: its result does not depend on the batch it
    is in (ART's union of those classes over the batch made it), and it fools the network about
    as often as DeepFool over every class, at about the same distance."""
    from training.attacks.batched import deepfool

    x, y = to_arrays(load_dataset("fashion-mnist", "test", root=data_root), 24, seed=2)
    xt = torch.from_numpy(x)
    kwargs = {"value_range": (0.0, 1.0), "max_iter": 20, "epsilon": 0.02}
    few = deepfool(network, xt, nb_grads=3, **kwargs)
    for part in (slice(0, 1), slice(1, 2), slice(2, 24)):
        alone = deepfool(network, xt[part], nb_grads=3, **kwargs)
        torch.testing.assert_close(alone, few[part], atol=1e-5, rtol=0)
    every = deepfool(network, xt, nb_grads=10, **kwargs)
    with torch.no_grad():
        z0, after, after_every = network(xt), network(few).argmax(1), network(every).argmax(1)
    moved = after != z0.argmax(1)
    assert moved.sum() >= 12
    assert abs(int(moved.sum()) - int((after_every != z0.argmax(1)).sum())) <= 2
    l2 = (few - xt).flatten(1).norm(dim=1)[moved]
    l2_every = (every - xt).flatten(1).norm(dim=1)[moved]
    assert float(l2.median()) == pytest.approx(float(l2_every.median()), rel=0.15)


def test_fgm_flips_some_predictions(network, images, tmp_path: Path) -> None:
    adv = _set(tmp_path, network, images, "fgm", {"eps": 0.3}, n=6)
    assert adv.success.sum() > (adv.clean_pred != adv.labels).sum()


def test_decision_based_results_are_cleared_off_the_boundary(network, images) -> None:
    """A point found by bisection within float rounding of the decision boundary (where the
    class can change with the batch size) is pushed along its ray until it is misclassified
    with the required logit margin; a point with no perturbation stays as it is."""
    x, _ = images
    runner = AttackRunner(network, "boundary", device="cpu")
    pred = runner.classifier.predict(x).argmax(1)
    source = 0
    target = int(np.flatnonzero(pred != pred[source])[0])
    inside, outside = x[source].copy(), x[target].copy()  # clean class / another class
    for _ in range(60):  # bisection to the boundary along the segment
        middle = (inside + outside) / 2
        if runner.classifier.predict(middle[None]).argmax(1)[0] == pred[source]:
            inside = middle
        else:
            outside = middle
    at_boundary = outside[None]
    logits = runner.classifier.predict(at_boundary)
    assert np.diff(np.sort(logits, axis=1)[:, -2:])[0, 0] < 1e-3  # really on the boundary
    originals = np.stack([x[source], x[1]])
    results = np.concatenate([at_boundary, x[1][None]])  # the second: attack found nothing
    cleared = clear_of_boundary(runner, originals, results, pred[[source, 1]], margin=1e-3)
    np.testing.assert_array_equal(cleared[1], x[1])
    moved = cleared[0] - x[source]
    overshoot = np.linalg.norm(moved) / np.linalg.norm(at_boundary[0] - x[source]) - 1
    assert 0 < overshoot <= max(OVERSHOOTS) + 1e-6
    for batch in (cleared[:1], cleared):  # the same class in any batch
        logits = runner.classifier.predict(batch)
        top = np.sort(logits[0])
        assert logits[0].argmax() != pred[source] and top[-1] - top[-2] >= 1e-3


@pytest.mark.parametrize("attack", ["apgd", "apgd-batched"])
def test_apgd_returns_misclassified_images_unchanged_and_the_pipeline_drops_them(
    attack: str, network, images, tmp_path: Path
) -> None:
    """ART's APGD only attacks images the network still classifies correctly: an image it
    already misclassifies comes back as it is, a clean image, which
    :func:`training.evaluation.context.perturbed` keeps out of the detection sets."""
    from training.evaluation.context import perturbed

    adv = _set(tmp_path, network, images, attack, {**TINY[attack], "eps": 0.1}, n=6)
    misclassified = adv.clean_pred != adv.labels
    unchanged = np.all(adv.x_adv == images[0][:6], axis=(1, 2, 3))
    assert misclassified.any() and not misclassified.all()  # both kinds among the 6 images
    np.testing.assert_array_equal(unchanged, misclassified)
    np.testing.assert_array_equal(perturbed(adv), ~unchanged)


def test_set_key_is_pinned() -> None:
    # Existing attack caches are found by this key: it must not change with refactors.
    fields = {"seed": 0, "network": "n" * 64, "indices": "i" * 64, "inputs": "x" * 64}
    params = {"eps": 0.1, "norm": "inf"}
    assert set_key(attack="fgm", params=params, **fields) == "ad880f59bf15c81c"
    assert (
        set_key(attack="fgm", params=dict(reversed(params.items())), **fields) == "ad880f59bf15c81c"
    )
    assert set_key(attack="fgm", params=params, **{**fields, "seed": 1}) != "ad880f59bf15c81c"


def test_a_different_parameter_makes_a_new_set(network, images, tmp_path: Path) -> None:
    first = _set(tmp_path, network, images, "fgm")
    other = _set(tmp_path, network, images, "fgm", {"eps": 0.05})
    reseeded = _set(tmp_path, network, images, "noise", seed=1)
    assert len({first.path, other.path, reseeded.path}) == 3
    assert not other.from_cache and np.abs(other.x_adv - images[0][:3]).max() > 0.031
    assert _set(tmp_path, network, images, "fgm", {"eps": 0.03}).path == first.path


def test_network_checksum_is_that_of_its_weights_file(
    network, network_dir: Path, images, tmp_path: Path
) -> None:
    assert network_sha256(network) == network_sha256(network_dir)
    from_memory = _set(tmp_path, network, images, "noise")
    from_dir = _set(tmp_path, network_dir, images, "noise")
    assert from_dir.from_cache and from_dir.path == from_memory.path


def test_interrupted_generation_resumes_from_finished_batches(
    network, images, tmp_path: Path
) -> None:
    params = {"max_iter": 2}
    calls: list[int] = []

    def interrupt_after_two(b: int, n: int) -> None:
        calls.append(b)
        if len(calls) == 2:
            raise KeyboardInterrupt

    def bim_set(folder: str, **options: Any) -> Any:
        return _set(tmp_path / folder, network, images, "bim", params, n=6, **options)

    with pytest.raises(KeyboardInterrupt):
        bim_set("a", batch_size=2, on_batch=interrupt_after_two)
    partial = [p for p in (tmp_path / "a").iterdir() if p.name.endswith(".partial")]
    assert len(partial) == 1 and len(list(partial[0].glob("batch-*.npz"))) == 2
    assert not [p for p in (tmp_path / "a").iterdir() if not p.name.endswith(".partial")]

    resumed_batches: list[int] = []
    # A different batch size asked on resume: the partial set's own batch size wins.
    resumed = bim_set("a", batch_size=4, on_batch=lambda b, n: resumed_batches.append(b))
    assert resumed_batches == [2] and resumed.manifest["batch_size"] == 2
    assert not partial[0].exists()
    whole = bim_set("b", batch_size=2)
    np.testing.assert_array_equal(resumed.x_adv, whole.x_adv)
    np.testing.assert_array_equal(resumed.adv_pred, whole.adv_pred)


def test_a_cache_that_does_not_match_its_manifest_is_refused(
    network, images, tmp_path: Path
) -> None:
    adv = _set(tmp_path, network, images, "noise")
    manifest_path, arrays_path = adv.path / "manifest.json", adv.path / "adversarial.npz"
    manifest = json.loads(manifest_path.read_text())

    manifest_path.write_text(json.dumps({**manifest, "n": 5}))
    with pytest.raises(ArtefactError, match="adversarial.npz.*n=5"):
        _set(tmp_path, network, images, "noise")

    manifest_path.write_text(json.dumps(manifest))
    with np.load(arrays_path, allow_pickle=False) as data:
        arrays = {k: data[k] for k in data.files}
    with open(arrays_path, "wb") as handle:
        np.savez(handle, **{**arrays, "x_adv": arrays["x_adv"][:2]})
    with pytest.raises(ArtefactError, match="adversarial.npz does not match the checksum"):
        load_adversarial_set(adv.path)

    manifest_path.write_text("{not json")
    with pytest.raises(ArtefactError, match="manifest.json"):
        _set(tmp_path, network, images, "noise")


def test_slow_attacks_announce_their_duration(network, images, tmp_path: Path, capsys) -> None:
    x, y = images
    get_or_generate(
        tmp_path,
        network,
        x[:2],
        y[:2],
        np.arange(2),
        "hsj",
        TINY["hsj"],
        device="cpu",
        progress=True,
    )
    err = capsys.readouterr().err
    assert "hsj: " in err and "min for the 1 remaining image(s) on 1 worker(s)" in err


@pytest.mark.slow
def test_workers_give_the_serial_result(network_dir: Path, images, tmp_path: Path) -> None:
    params = TINY["hsj"]
    parallel = _set(tmp_path / "p", network_dir, images, "hsj", params, n=2, workers=2)
    serial = _set(tmp_path / "s", network_dir, images, "hsj", params, n=2)
    assert parallel.manifest["workers"] == 2
    np.testing.assert_array_equal(parallel.x_adv, serial.x_adv)


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------
def _run_dir(tmp_path: Path, network, names: tuple[str, ...]) -> Path:
    run = tmp_path / "run"
    for name in names:
        directory = networks.save(network, run / "models" / name)
        (directory / "train_config.json").write_text(json.dumps({"dataset": "fashion-mnist"}))
    return run


def test_cli_without_a_trained_network_exits_2_and_writes_nothing(tmp_path: Path, capsys) -> None:
    run = tmp_path / "run"
    (run / "models" / "vanilla").mkdir(parents=True)  # a folder, but no network in it
    before = sorted(p.relative_to(run) for p in run.rglob("*"))
    assert main(["attack", "--run", str(run), "--attack", "fgm", "--n", "2"]) == 2
    assert "no trained network" in capsys.readouterr().err
    assert sorted(p.relative_to(run) for p in run.rglob("*")) == before
    assert main(["attack", "--run", str(tmp_path / "absent"), "--attack", "fgm"]) == 2
    assert not (tmp_path / "absent").exists()


def test_cli_rejects_bad_attacks_and_params(network, tmp_path: Path, capsys) -> None:
    run = _run_dir(tmp_path, network, ("vanilla",))
    assert main(["attack", "--run", str(run), "--attack", "pgd"]) == 2
    assert main(["attack", "--run", str(run), "--attack", "fgm", "--eps", "0"]) == 2
    assert main(["attack", "--run", str(run), "--attack", "cw", "--param", "eps=0.1"]) == 2
    assert "unknown parameter" in capsys.readouterr().err
    assert not (run / "attacks").exists()


def test_cli_attacks_every_network_and_lists_the_registry(
    network, data_root: Path, tmp_path: Path, capsys
) -> None:
    run = _run_dir(tmp_path, network, ("lap", "vanilla"))
    argv = [
        "attack",
        "--run",
        str(run),
        "--attack",
        "bim",
        "--n",
        "4",
        "--param",
        "max_iter=2",
        "--eps",
        "0.1",
        "--root",
        str(data_root),
        "--no-progress",
        "--device",
        "cpu",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "lap" in out and "vanilla" in out and "success" in out
    for name in ("lap", "vanilla"):
        (folder,) = (run / "attacks" / name).iterdir()
        adv = load_adversarial_set(folder)
        assert (
            adv.manifest["params"]["eps"] == 0.1
            and adv.manifest["params"]["max_iter"] == 2
            and len(adv) == 4
        )
    assert main([*argv, "--model", "lap"]) == 0
    out = capsys.readouterr().out
    assert "(cached)" in out and "vanilla" not in out
    assert main(["attack", "--list"]) == 0
    listing = capsys.readouterr().out
    assert all(name in listing for name in ATTACKS)
