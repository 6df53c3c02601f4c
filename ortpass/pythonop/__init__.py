"""The ``torch.autograd.Function`` feature, whole: exporting a Function as a
``com.microsoft::PythonOp`` (:mod:`.export`, :mod:`.custom_op`), its per-Function shape
inference (:mod:`.shape_inference`), and the bridge that runs it from ONNX Runtime
(:mod:`.bridge`).  Only the bridge and the exporter need torch, and they import it when used."""
