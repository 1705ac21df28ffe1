"""``mcore_npu.transformer.megatron_features``, against the installed megatron-core (``make
test-compat`` runs this on every admitted version; the version string is read here, in the
test, and nowhere in the package):

- every feature of ``FEATURES`` is present exactly in the releases its table entry names;
- a field listed from version V on exists exactly when the installed version is V or newer.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from mcore_npu.transformer import megatron_features
from mcore_npu.transformer.megatron_features import (
    FIELDS_SINCE,
    REMOVED_AFTER,
    install_hint,
    version_with,
)

pytestmark = pytest.mark.cpu_only


def _installed() -> tuple[tuple[int, int], set[str]]:
    from megatron.core import package_info
    from megatron.core.transformer.transformer_config import TransformerConfig

    major, minor = (int(x) for x in package_info.__version__.split(".")[:2])
    return (major, minor), {f.name for f in dataclasses.fields(TransformerConfig)}


def _minor(version: str) -> tuple[int, int]:
    major, minor = version.split(".")
    return int(major), int(minor)


@pytest.mark.parametrize("since", sorted(FIELDS_SINCE))
def test_a_field_exists_from_its_version_on(since):
    installed, fields = _installed()
    present = [name for name in FIELDS_SINCE[since] if name in fields]
    want = list(FIELDS_SINCE[since]) if installed >= _minor(since) else []
    assert present == want, (installed, since)


@pytest.mark.parametrize("last", sorted(REMOVED_AFTER))
def test_a_removed_field_exists_up_to_its_last_version(last):
    installed, fields = _installed()
    present = [name for name in REMOVED_AFTER[last] if name in fields]
    want = list(REMOVED_AFTER[last]) if installed <= _minor(last) else []
    assert present == want, (installed, last)


def test_the_words_name_the_version():
    assert version_with("moe_shared_expert_gate") == "megatron-core 0.16+"
    assert version_with("moe_extended_tp") == "megatron-core 0.16 (removed in 0.17)"
    assert version_with("hidden_size") is None and install_hint("no_such_field") is None
    hint = install_hint("batch_invariant_mode")
    assert (
        hint
        == "megatron-core 0.16+ has batch_invariant_mode: install that version, or remove the key"
    )


@pytest.mark.parametrize("name", sorted(megatron_features.FEATURES))
def test_a_feature_is_present_exactly_in_its_releases(name):
    feature = megatron_features.FEATURES[name]
    installed, _ = _installed()
    after_start = feature.since is None or installed >= _minor(feature.since)
    before_end = feature.until is None or installed <= _minor(feature.until)
    assert megatron_features.has(name) == (after_start and before_end), (installed, feature)


def test_an_unknown_feature_is_refused_with_the_known_ones():
    with pytest.raises(ValueError, match="feature: 'router' is not one of router_slot"):
        megatron_features.has("router")


def test_no_module_of_the_package_reads_the_megatron_version():
    """Features are read from the installed objects: nothing outside doctor (its supported-range
    line) reads the megatron-core version."""
    package = Path(megatron_features.__file__).resolve().parents[1]
    readers = []
    for path in sorted(package.rglob("*.py")):
        text = path.read_text()
        if any(s in text for s in ('version("megatron', "package_info", "core.__version__")):
            readers.append(str(path.relative_to(package)))
    assert readers == ["tools/doctor.py"]
