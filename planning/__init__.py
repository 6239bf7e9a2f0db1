"""Capacity arithmetic before and during a run: FLOP and parameter counts (`flops`), the
device's peak FLOP/s for MFU (`peak`) and the dry-run memory planner (`plan`)."""
