"""lampdist on Ray: inside Ray Train's ``TorchTrainer`` (:func:`from_train_context`).

Imports Ray only when a function here is called; ``import lampdist`` never imports this
package. Install Ray with ``pip install 'lampdist[ray]'``.
"""

from ._train import TrainSecret, from_train_context, report, resume, storage_dir

__all__ = ["TrainSecret", "from_train_context", "report", "resume", "storage_dir"]
