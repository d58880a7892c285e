"""Real-time card-fraud detection on real ULB transactions: teacher → distilled student → compressed bundle →
budgeted streaming scorer. See samples/fraud/README.md; ``python -m samples.fraud.run`` runs it end to end."""
