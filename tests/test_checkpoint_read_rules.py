"""dist/checkpoint_read.py at its edges: the boundary values a healthy run saves load (iteration 0, seed 2**32 - 1,
an all-zero exp_avg_sq, an empty float tensor), the first value past each bound is refused by name, a nan inside
a tuple (Adam's betas) is found, a truncated file, a directory, a non-archive, a dangling link, a file that fails its
CRC-32s and one of another format version each get their own words, an entry missing or not a dict is named, a config
lacking any one founding setting or with a section, seed or env_seed of the wrong type is damage, and a file written
before "layout" was saved loads."""

import dataclasses
import math
import struct

import pytest
import torch

from configs import preset
from dist.checkpoint import save_checkpoint
from dist.checkpoint_read import load_checkpoint
from dist.errors import UsageError


def _config(**top) -> dict:
    """A cartpole run's whole config (every setting a checkpoint has had since the first version), `top` replaced."""
    return {**dataclasses.asdict(preset("cartpole")), **top}


def _state(**changes) -> dict:
    """The smallest dict load_checkpoint accepts, one Adam parameter group with one parameter."""
    state = {"model": {"w": torch.tensor([0.5, -1.0])},
             "optimizer": {"param_groups": [{"params": [0], "lr": 1e-3, "betas": (0.9, 0.999)}],
                           "state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.tensor([0.1, -0.2]),
                                         "exp_avg_sq": torch.tensor([0.01, 0.04])}}},
             "iteration": 2, "learning_rate": 1e-3, "env": {}, "config": _config(),
             "rng": [{"torch": torch.get_rng_state()}], "layout": [1, 0]}
    state.update(changes)
    return state


def _saved(tmp_path, state) -> str:
    path = str(tmp_path / "model_2.pt")
    save_checkpoint(path, state)
    return path


def _with_group(**group):
    state = _state()
    state["optimizer"]["param_groups"][0].update(group)
    return state


def _with_moments(**moments):
    state = _state()
    state["optimizer"]["state"][0].update(moments)
    return state


@pytest.mark.parametrize("state", [
    _state(iteration=0),                                         # saved before the first update: "an integer >= 0"
    _state(config=_config(seed=2**32 - 1)),      # the largest --seed
    _state(env_seed=2**32 - 1),
    _with_moments(exp_avg_sq=torch.zeros(2)),                   # a parameter that never had a gradient: 0 is a square
    _state(model={"w": torch.tensor([0.5]), "empty": torch.zeros(0)}),     # a 0-element float tensor has no extremes
    _with_group(lr=torch.tensor(1e-3)),                          # --ppo.capture-step: a one-element tensor
    _with_group(lr=1),                                           # an integer is a number too
], ids=["iteration-0", "seed-2**32-1", "env_seed-2**32-1", "zero-exp_avg_sq", "empty-tensor", "tensor-lr", "int-lr"])
def test_values_a_healthy_run_saves_at_their_bounds_load(tmp_path, state):
    loaded = load_checkpoint(_saved(tmp_path, state))
    assert loaded["iteration"] == state["iteration"]


@pytest.mark.parametrize("state, what", [
    (_state(config=_config(seed=2**32)),
     "is damaged (its config's seed is 4294967296, not an integer in [0, 2**32)); resume from another checkpoint"),
    (_state(env_seed=2**32), "is damaged (its env_seed is 4294967296, not an integer in [0, 2**32)); resume from "
                             "another checkpoint"),
    (_state(iteration=-1), "is damaged (its iteration is -1, not an integer >= 0); resume from another checkpoint"),
    (_with_group(lr=torch.tensor([1e-3, 1e-3])),
     "is damaged (its optimizer param group 0 has lr tensor([0.0010, 0.0010]), not a number); resume from another "
     "checkpoint"),
    (_with_group(betas=(math.nan, 0.999)), "has nan in its optimizer['param_groups'][0]['betas'][0]: the file is "
                                           "damaged or its run diverged; resume from an earlier model_<k>.pt"),
    (_with_group(betas=(0.9, math.inf)), "has inf in its optimizer['param_groups'][0]['betas'][1]: the file is "
                                         "damaged or its run diverged; resume from an earlier model_<k>.pt"),
    (_with_moments(exp_avg_sq=torch.tensor([0.0, -1e-8])),
     "has a negative value (-1e-08) in its optimizer['state'][0]['exp_avg_sq'], a mean of squares: the file is "
     "damaged or its run diverged; resume from an earlier model_<k>.pt"),
    # both an entry restore cannot use and a nan: the entry is named (its types are checked before any value is read)
    (_state(iteration=-1, model={"w": torch.tensor([math.nan])}),
     "is damaged (its iteration is -1, not an integer >= 0); resume from another checkpoint"),
], ids=["seed-2**32", "env_seed-2**32", "iteration--1", "two-element-lr", "nan-beta", "inf-beta", "negative-square",
        "malformed-before-nan"])
def test_the_first_value_past_each_bound_is_refused_naming_it(tmp_path, state, what):
    path = _saved(tmp_path, state)
    with pytest.raises(UsageError) as exc:
        load_checkpoint(path)
    assert str(exc.value) == f"--resume {path!r} {what}"


def _config_without(*names) -> dict:
    config = _config()
    config["env"], config["ppo"] = dict(config["env"]), dict(config["ppo"])
    for name in names:
        section, _, key = name.rpartition(".")
        del (config[section] if section else config)[key]
    return config


@pytest.mark.parametrize("config, lacking", [
    (_config_without("env.num_envs"), "env.num_envs"),
    (_config_without("ppo.num_steps", "seed"), "ppo.num_steps, seed"),
    ({}, "env.name, env.num_envs, env.episode_length_s"),
])
def test_a_config_without_a_setting_every_checkpoint_has_had_is_damage(tmp_path, config, lacking):
    """A setting newer than a checkpoint takes its earlier behaviour; one the first version already saved cannot be
    missing from a checkpoint train.py wrote. Taken as newer, a config without env.num_envs resumed at the
    dataclass default of 256 envs (not the run's), and the env-count check compared against that."""
    path = _saved(tmp_path, _state(config=config))
    with pytest.raises(UsageError) as exc:
        load_checkpoint(path)
    assert str(exc.value).startswith(f"--resume {path!r} is damaged (its config lacks {lacking}")
    assert str(exc.value).endswith("); resume from another checkpoint")


def test_every_setting_a_checkpoint_must_have_is_a_setting_of_this_version():
    """FOUNDING_SETTINGS names fields of today's Config (a renamed one would refuse every checkpoint)."""
    from dist.checkpoint_read import FOUNDING_SETTINGS
    config = _config()
    assert all(n.rpartition(".")[2] in (config[n.partition(".")[0]] if "." in n else config) for n in FOUNDING_SETTINGS)


def _philox(seed: int, offset: int) -> torch.Tensor:
    """A CUDA generator's 16-byte state: its Philox seed, then its offset, each a little-endian uint64."""
    return torch.tensor(list(struct.pack("<QQ", seed, offset)), dtype=torch.uint8)


@pytest.mark.parametrize("offset", [0, 4, 12, 2**40 + 8, 2**64 - 4])
def test_a_gpu_generator_s_state_at_any_philox_offset_a_multiple_of_4_loads(tmp_path, offset):
    """A GPU run's generator advances its offset by multiples of 4, not of 8: 4 and 12 are states it saves."""
    state = _state(rng=[{"torch": torch.get_rng_state(), "cuda": _philox(2**63 + 5, offset)}])
    assert load_checkpoint(_saved(tmp_path, state))["rng"][0]["cuda"].tolist() == _philox(2**63 + 5, offset).tolist()


@pytest.mark.parametrize("offset", [2, 13, 2**40 + 6, 2**64 - 1])
def test_a_gpu_generator_s_state_at_a_philox_offset_torch_refuses_is_refused_naming_it(tmp_path, offset):
    path = _saved(tmp_path, _state(rng=[{"torch": torch.get_rng_state(), "cuda": _philox(4, offset)}]))
    with pytest.raises(UsageError) as exc:
        load_checkpoint(path)
    assert str(exc.value).startswith(f"--resume {path!r} is damaged (its rng[0]['cuda'] (16 bytes) is not the state "
                                     f"of a torch generator)")


def test_a_truncated_checkpoint_a_directory_and_a_non_archive_each_say_what_they_are(tmp_path):
    path = _saved(tmp_path, _state())
    data = open(path, "rb").read()
    assert data[:4] == b"PK\x03\x04"                           # a zip archive starts with a local file header
    cut = tmp_path / "cut.pt"
    cut.write_bytes(data[:len(data) // 2])                     # the archive's closing directory is gone
    with pytest.raises(UsageError) as exc:
        load_checkpoint(str(cut))
    assert str(exc.value) == f"--resume {str(cut)!r} is a truncated or damaged checkpoint (its zip archive does not " \
                             "end); use another one"
    text = tmp_path / "notes.pt"
    text.write_text("hello")
    with pytest.raises(UsageError) as exc:
        load_checkpoint(str(text))
    assert str(exc.value) == f"--resume {str(text)!r} is not a torch checkpoint (torch.save writes a zip archive; " \
                             "this file is not one): pass a model_<iteration>.pt file train.py wrote"
    with pytest.raises(UsageError) as exc:
        load_checkpoint(str(tmp_path))
    assert str(exc.value) == f"--resume {str(tmp_path)!r} is a directory; pass a model_<iteration>.pt file inside " \
                             "it, or auto"


@pytest.mark.parametrize("entry", ["first", "last"])
def test_a_flipped_bit_in_the_archive_index_is_a_damaged_checkpoint_not_a_bad_zip_traceback(tmp_path, entry):
    """The end record found, the central directory behind it unreadable: zipfile raised BadZipFile, which every
    reader (--resume, make export, bench_sync) reported as a bug with its traceback."""
    path = _saved(tmp_path, _state())
    data = bytearray(open(path, "rb").read())
    # The signature of an entry of the central directory (one per member, found from the end record)
    data[data.index(b"PK\x01\x02") if entry == "first" else data.rindex(b"PK\x01\x02")] ^= 4
    open(path, "wb").write(bytes(data))
    with pytest.raises(UsageError, match=r"^--resume '.*' is a damaged checkpoint \(its zip archive's index is "
                                         r"unreadable: .*\); use another one$"):
        load_checkpoint(path)


def test_a_checkpoint_of_two_learners_written_before_layout_was_saved_loads(tmp_path):
    """Without "layout" a checkpoint says [one learner per saved RNG state, no rollout rank] (ppo/restore.py reads it
    so too): a 2-rank run's file is not refused as a layout of 1 learner."""
    state = _state(rng=[{"torch": torch.get_rng_state()}, {"torch": torch.get_rng_state()}])
    del state["layout"]
    loaded = load_checkpoint(_saved(tmp_path, state))
    assert len(loaded["rng"]) == 2 and "layout" not in loaded


@pytest.mark.parametrize("section", ["env", "policy", "ppo", "dist", "log", "rollout"])
def test_every_config_section_that_is_not_a_dict_is_damage_naming_it(tmp_path, section):
    path = _saved(tmp_path, _state(config={**_config_without(), section: 3}))
    with pytest.raises(UsageError) as exc:
        load_checkpoint(path)
    assert str(exc.value) == (f"--resume {path!r} is damaged (its config section {section!r} is not a dict); resume "
                              f"from another checkpoint")


@pytest.mark.parametrize("changes, shown", [
    ({"env_seed": 3.0}, "its env_seed is 3.0"),
    ({"config": {**_config_without(), "seed": True}}, "its config's seed is True"),
], ids=["float-env_seed", "bool-seed"])
def test_a_seed_that_is_a_float_or_a_bool_is_not_an_integer(tmp_path, changes, shown):
    path = _saved(tmp_path, _state(**changes))
    with pytest.raises(UsageError) as exc:
        load_checkpoint(path)
    assert str(exc.value) == (f"--resume {path!r} is damaged ({shown}, not an integer in [0, 2**32)); resume from "
                              f"another checkpoint")


# The settings the first checkpoint format already saved, written out by hand (a config lacking one resumed at the
# dataclass default instead of the run's value).
FOUNDING = ["env.name", "env.num_envs", "env.episode_length_s", "env.num_motions", "env.sampling_uniform_floor",
            "policy.actor_hidden", "policy.critic_hidden", "policy.activation", "policy.init_noise_std",
            "policy.normalize_critic_obs", "policy.normalize_actor_obs", "ppo.num_steps", "ppo.num_epochs",
            "ppo.num_mini_batches", "ppo.learning_rate", "ppo.schedule", "ppo.desired_kl", "ppo.lr_min", "ppo.lr_max",
            "ppo.gamma", "ppo.lam", "ppo.clip_param", "ppo.clip_value_loss", "ppo.value_loss_coef",
            "ppo.entropy_coef", "ppo.max_grad_norm", "ppo.advantage_norm", "max_iterations", "seed"]


@pytest.mark.parametrize("name", FOUNDING)
def test_a_config_lacking_any_one_founding_setting_is_damage_naming_it(tmp_path, name):
    path = _saved(tmp_path, _state(config=_config_without(name)))       # a fresh config, one setting deleted
    with pytest.raises(UsageError) as exc:
        load_checkpoint(path)
    assert str(exc.value) == f"--resume {path!r} is damaged (its config lacks {name}); resume from another checkpoint"


@pytest.mark.parametrize("key", ["model", "optimizer", "env", "config"])
def test_each_entry_restore_loads_as_a_dict_is_refused_by_name_when_it_is_not_one(tmp_path, key):
    """restore passes 'model', 'optimizer' and 'env' to load_state_dict and reads 'config' by key: a list there is
    one UsageError naming the entry when the file is read, not a TypeError from inside a load_state_dict."""
    from dist.checkpoint_read import load_checkpoint
    from tests.test_checkpoint_rules import _minimal_checkpoint
    path = str(tmp_path / "model_2.pt")
    save_checkpoint(path, _minimal_checkpoint(**{key: [1.0]}))
    with pytest.raises(UsageError, match=f"^--resume '{path}' is damaged \\(its '{key}' is a list, not a dict\\); "
                                         f"resume from another checkpoint$"):
        load_checkpoint(path)


def test_a_checkpoint_of_another_syncppo_format_version_says_so(tmp_path):
    """A v2 file (a later version's) read by this v1 reader: the message names both formats and the way out (the
    version that wrote it), not "not a syncppo checkpoint"."""
    from dist.checkpoint_read import load_checkpoint
    from tests.test_checkpoint_rules import _minimal_checkpoint
    path = str(tmp_path / "model_2.pt")
    save_checkpoint(path, _minimal_checkpoint())
    state = torch.load(path, weights_only=True)
    assert state["format"] == "syncppo-checkpoint-v1"
    torch.save({**state, "format": "syncppo-checkpoint-v2"}, path)
    with pytest.raises(UsageError, match=f"^--resume '{path}' was written by another syncppo version \\(format "
                                         f"'syncppo-checkpoint-v2'; this one reads 'syncppo-checkpoint-v1'\\): "
                                         f"resume it with the version that wrote it$"):
        load_checkpoint(path)


def test_a_resume_path_the_shell_left_with_its_tilde_says_so(tmp_path, monkeypatch):
    """`--resume=~/runs/.../model_2.pt`: the shell expands no '~' after '=', and the path was only said not to exist,
    though the file is there under $HOME.
    Mutant: the tilde hint dropped from checked_checkpoint."""
    from dist.checkpoint_read import load_checkpoint
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UsageError, match=r"^--resume '~/runs/model_2.pt' does not exist \(the shell does not expand a "
                                         r"'~' after '--resume=': write --resume ~/\.\.\., with a space\); pass "):
        load_checkpoint("~/runs/model_2.pt")


def test_a_resume_path_that_is_a_dangling_link_is_called_one_not_missing(tmp_path):
    """os.path.exists follows links: a link to a deleted checkpoint reads as missing, which would send the user
    looking for the link itself; the message says it is there and where the trouble is."""
    from dist.checkpoint_read import load_checkpoint
    link = tmp_path / "model_2.pt"
    link.symlink_to(tmp_path / "deleted.pt")
    with pytest.raises(UsageError, match=f"^--resume '{link}' is a symbolic link whose target does not exist \\(or "
                                         f"that loops\\); pass an existing model_<iteration>.pt file"):
        load_checkpoint(str(link))
    with pytest.raises(UsageError, match=f"^--resume '{tmp_path / 'gone.pt'}' does not exist; pass an existing "):
        load_checkpoint(str(tmp_path / "gone.pt"))


def test_a_file_that_fails_its_crc_is_called_damaged_before_any_entry_is_judged(tmp_path):
    """The CRC-32s come first: a flipped bit can turn any entry into nonsense, so a file that fails them is called
    damaged (and the member named), not judged by the entry it happens to garble (a bool iteration here)."""
    from dist.checkpoint_read import load_checkpoint
    from tests.test_bad_input import flip_a_byte_of_tensor_data
    from tests.test_checkpoint_rules import _minimal_checkpoint
    path = tmp_path / "model_2.pt"
    save_checkpoint(str(path), _minimal_checkpoint(iteration=True, model={"w": torch.ones(64)}))
    flip_a_byte_of_tensor_data(path)
    with pytest.raises(UsageError, match=r"^--resume .* is damaged \(archive/data/\d+ does not match its CRC-32\); "
                                         r"resume from another checkpoint$"):
        load_checkpoint(str(path))


@pytest.mark.parametrize("key", ["model", "optimizer", "iteration", "learning_rate", "env", "config", "rng"])
def test_a_checkpoint_without_any_entry_a_save_always_writes_is_refused_naming_it(tmp_path, key):
    """dist/checkpoint.py writes the model and optimizer states, the iteration, the LR, the env's state, the config
    and the RNG states every time: a file without one is truncated or another tool's, even where resume would not
    read it (the LR: the optimizer's param groups hold it)."""
    from dist.checkpoint_read import load_checkpoint
    from tests.test_checkpoint_rules import _minimal_checkpoint
    path = str(tmp_path / "model_2.pt")
    state = _minimal_checkpoint()
    del state[key]
    save_checkpoint(path, state)
    with pytest.raises(UsageError, match=f"^--resume '{path}' is missing \\['{key}'\\]; the file is truncated"):
        load_checkpoint(path)
