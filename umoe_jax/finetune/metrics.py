"""Classification metrics: accuracy, macro-F1, the confusion matrix, the majority-class baseline.

  confusion[t, p] = number of examples of true class t predicted as p
  precision_c = confusion[c, c] / sum_t confusion[t, c]     (0 when nothing is predicted as c)
  recall_c    = confusion[c, c] / sum_p confusion[c, p]     (0 when c has no example)
  F1_c        = 2 P R / (P + R)                               (0 when P + R = 0)
  macro-F1    = mean of F1_c over the classes that occur as a true or a predicted label
                (scikit-learn's f1_score(average="macro") without a `labels` argument)
"""
from __future__ import annotations

import numpy as np


def confusion_matrix(labels: np.ndarray, preds: np.ndarray, num_classes: int) -> np.ndarray:
  """int64 [C, C]; rows true classes, columns predictions."""
  labels = np.asarray(labels, np.int64)
  preds = np.asarray(preds, np.int64)
  if labels.shape != preds.shape:
    raise ValueError(f"labels {labels.shape} and predictions {preds.shape} differ in shape")
  flat = np.bincount(labels * num_classes + preds, minlength=num_classes * num_classes)
  return flat.reshape(num_classes, num_classes)


def classification_metrics(labels: np.ndarray, preds: np.ndarray, num_classes: int) -> dict:
  """{"accuracy", "macro_f1", "f1" [C] list, "count"} of integer class ids."""
  cm = confusion_matrix(labels, preds, num_classes).astype(np.float64)
  n = cm.sum()
  if n == 0:
    raise ValueError("no examples to score")
  tp = np.diag(cm)
  predicted, actual = cm.sum(axis=0), cm.sum(axis=1)
  precision = np.divide(tp, predicted, out=np.zeros_like(tp), where=predicted > 0)
  recall = np.divide(tp, actual, out=np.zeros_like(tp), where=actual > 0)
  denom = precision + recall
  f1 = np.divide(2 * precision * recall, denom, out=np.zeros_like(tp), where=denom > 0)
  present = (predicted > 0) | (actual > 0)
  return {"accuracy": float(tp.sum() / n), "macro_f1": float(f1[present].mean()),
          "f1": f1.tolist(), "count": int(n)}


def majority_accuracy(train_labels: np.ndarray, labels: np.ndarray, num_classes: int) -> float:
  """Accuracy on `labels` of always predicting the most frequent training class (lowest id on ties)."""
  majority = int(np.argmax(np.bincount(np.asarray(train_labels, np.int64), minlength=num_classes)))
  return float(np.mean(np.asarray(labels) == majority))
