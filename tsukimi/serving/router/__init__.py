"""The router process: places requests on workers (the Conductor in PD mode), streams their tokens back."""
