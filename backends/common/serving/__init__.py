"""Triton's Python backend at the edge: requests and responses (triton_io, the seam tests fake), the wire messages
between roles, decode's stream sender, metrics."""
