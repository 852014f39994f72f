"""Measurements on a module by running it: probe inputs and routing (block), activation functions fitted on probes
(activations, softcap). Used by the experts interface, verify and the readers."""
