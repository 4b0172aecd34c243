from hf_stable.export.reference import REFERENCE_FILE

__all__ = ["REFERENCE_FILE"]
