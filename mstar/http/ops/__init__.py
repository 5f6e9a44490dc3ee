"""The operator's routes beside the model's: `/metrics`, `/debug/profile`
and the browser demo at `/`."""
