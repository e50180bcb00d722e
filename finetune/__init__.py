"""finetune: fine-tune Llama-style models on the Hugging Face stack, from one CPU to many GPUs."""

__version__ = "0.1.0"


def _quiet_imports() -> None:
    # Before any library import can log: bitsandbytes' notice about a Hub kernel; bitsandbytes imported only where
    # it is used (finetune.compat says why for both).
    from finetune import compat

    compat.quiet_bnb_cpu_kernel_notice()
    compat.defer_bitsandbytes_import()


_quiet_imports()
