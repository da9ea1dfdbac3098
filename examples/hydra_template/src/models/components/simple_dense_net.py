from torch import nn


class SimpleDenseNet(nn.Module):
    """A small fully-connected net (as in lightning-hydra-template)."""

    def __init__(self, input_size: int = 32, hidden_size: int = 64, output_size: int = 4) -> None:
        super().__init__()
        self.model = nn.Sequential(
            nn.Linear(input_size, hidden_size), nn.BatchNorm1d(hidden_size), nn.ReLU(),
            nn.Linear(hidden_size, hidden_size), nn.ReLU(),
            nn.Linear(hidden_size, output_size),
        )

    def forward(self, x):
        return self.model(x)
