"""The actor-critic's in-place activations against torch's out-of-place modules on the same weights."""

import copy

import pytest
import torch
from torch import nn

from ppo.actor_critic import ActorCritic

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
