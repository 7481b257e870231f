"""Model card templates (Jinja), shipped inside the package as `hf_actcomp.model_cards`."""
