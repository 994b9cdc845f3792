"""The torch.compile backend: passes, splitting at attention, piece builds, the compile cache."""
