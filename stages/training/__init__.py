"""What changes the weights: SFT, GRPO (plan, step, loop), the DPO family, reward models (ORM/PRM), EBFT
(whole and strided), the one TRL-trainer setup they share, and export (LoRA merge)."""
