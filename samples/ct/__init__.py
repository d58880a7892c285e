"""CT sample app: real chest CT (DICOM + NIfTI), synthetic lesions inserted into the lungs, a 3-D CNN detector
trained with ``dsedge train``/``dsedge distill``, bundles for jetson and cpu, and budgeted sliding-window inference
through ``dsedge.load``. See samples/ct/README.md. The lesions are synthetic: neither volume has annotations."""
