"""The small model both examples use, and the weights a trainer has at each step."""
import torch


class TinyNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(64, 16)
        self.fc = torch.nn.Linear(16, 16)
        self.norm = torch.nn.LayerNorm(16)
        self.head = torch.nn.Linear(16, 8, bias=False)


def weights_at(step):
    """The state dict a trainer holds after `step` steps (deterministic, so a server can check)."""
    torch.manual_seed(1234)
    model = TinyNet()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.01 * step)
    return model.state_dict()


def split(state, buckets):
    """The state dict as `buckets` lists of (name, tensor), in order."""
    items = list(state.items())
    size = -(-len(items) // buckets)
    return [items[i:i + size] for i in range(0, len(items), size)]
