"""The small model both examples use, and how the trainer trains it: a real AdamW step on a
batch that is a function of the step, so that anyone can replay the same weights (the server
checks what it loaded against such a replay, and a restarted trainer resumes that way)."""
import torch


class TinyNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(64, 16)
        self.fc = torch.nn.Linear(16, 16)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(8))
        self.norm = torch.nn.LayerNorm(16)
        self.head = torch.nn.Linear(16, 8, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = torch.relu(self.fc(self.embed(tokens)))
        for layer in self.layers:
            hidden = hidden + torch.relu(layer(hidden))
        return self.head(self.norm(hidden))


class Training:
    """A model and its optimizer; step() trains on the batch of the next step."""

    def __init__(self) -> None:
        torch.manual_seed(1234)
        self.model = TinyNet()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.steps = 0

    def step(self) -> None:
        generator = torch.Generator().manual_seed(self.steps)
        tokens = torch.randint(0, 64, (32,), generator=generator)
        targets = torch.randint(0, 8, (32,), generator=generator)
        loss = torch.nn.functional.cross_entropy(self.model(tokens), targets)
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        self.steps += 1

    def advance_to(self, steps: int) -> None:
        """Trains until `steps` steps are done (a restart resumes this way, as from a checkpoint)."""
        while self.steps < steps:
            self.step()


def split(names: list[str], buckets: int) -> list[list[str]]:
    """`names` as `buckets` lists, in order: which tensors travel in which bucket of an update."""
    return [names[i * len(names) // buckets:(i + 1) * len(names) // buckets] for i in range(buckets)]
