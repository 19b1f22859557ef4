"""What the `cohort` command line runs besides `train`: its arguments, SFT, reward models, the R1 pipeline, the demo,
the doctor's rehearsal, held-out evaluation and generation (`cohort generate`, `cohort chat`)."""
