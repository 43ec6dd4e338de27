"""The loop's parts: bookkeeping, schedule, seeding, resume check, progress, clock, signals."""
