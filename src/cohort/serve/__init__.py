"""Generation apart from training: rollout workers (`cohort serve`) and the trainer's client of them.

`protocol` (the messages and the checks each side makes of the other), `weights` (pushes over a
torch.distributed process group of its own), `worker` (the `cohort serve` process), `client`
(`RemoteGeneration`, the generation source of rollout.workers). docs/serving.md describes the contract.
"""
