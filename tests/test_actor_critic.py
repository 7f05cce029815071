"""The actor-critic's in-place activations against torch's out-of-place modules on the same weights, and its
constructor's defaults against the command line's, and the activation describe() names."""

import copy
import inspect

import pytest
import torch
from torch import nn

from configs import PolicyConfig
from ppo.actor_critic import ActorCritic
from ppo.normalizer import ObsNormalizer

OUT_OF_PLACE = {"elu": nn.ELU, "tanh": nn.Tanh, "relu": nn.ReLU}


def out_of_place_copy(model: ActorCritic, activation: str) -> ActorCritic:
    reference = copy.deepcopy(model)
    for net in (reference.actor, reference.critic):
        for i, layer in enumerate(net):
            if not isinstance(layer, nn.Linear):
                net[i] = OUT_OF_PLACE[activation]()
    return reference


@pytest.mark.parametrize("activation", ["elu", "tanh", "relu"])
def test_in_place_activations_compute_what_out_of_place_ones_do(activation):
    torch.manual_seed(0)
    model = ActorCritic(7, 9, 3, actor_hidden=(32, 16), critic_hidden=(24,), activation=activation)
    assert all(layer.inplace for net in (model.actor, model.critic) for layer in net
               if not isinstance(layer, (nn.Linear, nn.Tanh)))
    reference = out_of_place_copy(model, activation)
    actor_obs, critic_obs, actions = torch.randn(256, 7) * 3, torch.randn(256, 9) * 3, torch.randn(256, 3)

    grads = []
    for net in (model, reference):
        pi = net.distribution(actor_obs)
        loss = -pi.log_prob(actions).sum() + net.value(critic_obs).square().sum()
        net.zero_grad()
        loss.backward()
        grads.append([p.grad for p in net.parameters()])
        if net is model:
            outputs = (pi.mean.detach(), net.value(critic_obs).detach())
    assert torch.equal(outputs[0], reference.distribution(actor_obs).mean)   # forward: bit for bit
    assert torch.equal(outputs[1], reference.value(critic_obs))
    for ours, theirs in zip(*grads):
        if activation == "elu":   # backward from the output: grad * (out + 1) against grad * exp(x)
            torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
        else:                     # relu's mask and tanh's 1 - out^2 are the same either way
            assert torch.equal(ours, theirs)


def test_actor_critic_defaults_are_the_command_lines_defaults():
    """ActorCritic built directly (an evaluation script, an export, a user of the module) must be the model train.py
    builds with default flags: a default without the critic's normalizer would give a model whose state_dict lacks
    `critic_normalizer.*` (a checkpoint of a default run would not load) and whose critic sees raw observations."""
    model = ActorCritic(3, 4, 2)
    assert isinstance(model.critic_normalizer, ObsNormalizer) and isinstance(model.actor_normalizer, nn.Identity)
    assert [m.out_features for m in model.actor if isinstance(m, nn.Linear)] == [128, 128, 2]
    assert torch.equal(model.log_std.detach(), torch.zeros(2))                 # init_noise_std 1
    defaults = {name: p.default for name, p in inspect.signature(ActorCritic).parameters.items()
                if p.default is not inspect.Parameter.empty}
    cfg = PolicyConfig()
    assert defaults == {name: getattr(cfg, name) for name in defaults}
    assert len(defaults) == 7


def test_describe_names_the_activation_not_a_normalization_layer_between():
    """A fork that puts a LayerNorm between each Linear and its activation (the usual first change) printed
    `(layernorm)` where the start-up names the activation: describe took the first module that is not a Linear.
    Mutant: describe's `isinstance(m, kinds)` back to `not isinstance(m, nn.Linear)`."""
    model = ActorCritic(3, 5, 2, actor_hidden=(8,), critic_hidden=(8,), activation="tanh")
    for net in (model.actor, model.critic):
        net.insert(1, nn.LayerNorm(8))
    assert model.describe() == f"actor 3-8-2, critic 5-8-1 (tanh), {sum(p.numel() for p in model.parameters()):,} " \
                               f"parameters"
